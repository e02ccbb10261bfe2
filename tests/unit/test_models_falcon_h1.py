"""Falcon-H1: every layer runs attention and Mamba2 side by side, so every layer holds KV rows
and a Mamba slot; the three ways its Mamba combines the scan with the gate (norm before the
gate, gate before the norm, gate only) and tied embeddings match transformers' logits at TP 1
and 2; a config written the way released checkpoints spell it (top-level rope_theta,
head_dim, attn_layer_indices: null, mamba_use_mlp, mlp_expansion_factor) is read, and values
Hyrax does not implement are refused by key. (The fully multiplied variant's greedy tokens,
retraction and float16: test_models_checkpoints.py.)"""
from __future__ import annotations

import json

import pytest
import torch

import hf_families as hff
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.sharding import TP
from hyrax.actors.model.state import derive_components
from test_config_errors import raises_input_error

transformers = pytest.importorskip("transformers")
from test_models_checkpoints import falcon_h1  # noqa: E402

VARIANTS = {
    "norm_then_gate": {},
    "gate_then_norm": dict(mamba_norm_before_gate=False),
    "gate_only_tied": dict(mamba_rms_norm=False, tie_word_embeddings=True),
}


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = hff.randomize_hf_(falcon_h1(**VARIANTS[request.param]).eval())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return request.param, path, hf


def test_every_layer_holds_attention_and_mamba_state(variant):
    name, path, _ = variant
    cfg = ModelConfig.from_dir(path)
    assert cfg.layer_types == ("attention_mamba2",) * 3
    assert cfg.mamba_norm == name.removesuffix("_tied")
    assert cfg.mamba_intermediate == 96  # mamba_d_ssm, not mamba_expand * hidden_size (128)
    comps = {c.name: c.layers for c in derive_components(cfg, TP(1, 2))}
    assert comps == {"full_kv": (0, 1, 2), "mamba_conv": (0, 1, 2), "mamba_ssm": (0, 1, 2)}


def test_logits_match_transformers_chunked_and_at_tp2(variant):
    _, path, hf = variant
    ids = hff.prompts((21,))[0]
    assert hff.teacher_forced_max_diff(path, hf, ids, [8, 5, 8]) < 1e-4
    assert hff.teacher_forced_max_diff(path, hf, ids, [16, 1, 1, 1, 1, 1]) < 1e-4  # decode steps
    ref = hff.hf_logits(hf, ids)
    for logits in hff.rank_logits(path, 2, ids, [8, 13]):
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def _config_dict(tmp_path) -> dict:
    falcon_h1().config.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


def test_released_checkpoint_spelling_is_read(tmp_path):
    d = _config_dict(tmp_path)
    ref = ModelConfig.from_hf_dict(d)
    theta = d.pop("rope_parameters")["rope_theta"]
    d.update(rope_theta=theta, rope_scaling=None, head_dim=16, attn_layer_indices=None, mamba_use_mlp=True,
             mlp_expansion_factor=8, torch_dtype="bfloat16", mamba_d_head="auto")
    assert ModelConfig.from_hf_dict(d) == ref


@pytest.mark.parametrize("key,value,fragment", [
    ("attn_layer_indices", [0], "'attn_layer_indices'"),
    ("mamba_use_mlp", False, "'mamba_use_mlp'"),
    ("sliding_window", 16, "'sliding_window'"),
    ("ssm_multipliers", [1.0, 1.0], "'ssm_multipliers'"),
    ("mamba_d_head", 8, "mamba_d_head"),
])
def test_unimplemented_falcon_values_are_refused_by_key(tmp_path, key, value, fragment):
    d = _config_dict(tmp_path)
    d[key] = value
    raises_input_error(lambda: ModelConfig.from_hf_dict(d), fragment)
