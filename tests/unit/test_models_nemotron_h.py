"""A NemotronH checkpoint (pattern-defined Mamba2 / attention / relu2-MLP / MoE layers) written by
transformers loads unchanged and computes what transformers computes: teacher-forced
logits, and greedy tokens through the engine at TP 1 and 2, under forced retraction."""
from __future__ import annotations

import json

import pytest
import torch

import hf_families as hff
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.state import derive_components

transformers = pytest.importorskip("transformers")

PATTERN = "M*-EM-*E"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    hc = transformers.NemotronHConfig(
        vocab_size=hff.VOCAB, hidden_size=64, hybrid_override_pattern=PATTERN,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=96,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=1.5,
        initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0,
    )
    hf = hff.randomize_hf_(transformers.NemotronHForCausalLM(hc).eval())
    path = tmp_path_factory.mktemp("nemotron_h")
    hf.save_pretrained(path)
    return path, hf


def test_pattern_becomes_layer_types_and_components(checkpoint):
    path, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    assert cfg.layer_types == ("mamba2", "full_attention", "ffn_only", "ffn_only",
                               "mamba2", "ffn_only", "full_attention", "ffn_only")
    assert cfg.ffn_types == ("none", "none", "relu2", "moe", "none", "relu2", "none", "moe")
    comps = {c.name: c.layers for c in derive_components(cfg)}
    assert comps == {"full_kv": (1, 6), "mamba_conv": (0, 4), "mamba_ssm": (0, 4)}


def test_legacy_hybrid_override_pattern_config_is_read(checkpoint):
    path, _ = checkpoint
    d = json.loads((path / "config.json").read_text())
    d.pop("layers_block_type")
    d["hybrid_override_pattern"] = PATTERN
    d["num_hidden_layers"] = len(PATTERN)
    assert ModelConfig.from_hf_dict(d) == ModelConfig.from_dir(path)


@pytest.mark.parametrize("chunks", [[21], [8, 5, 8]], ids=["one_chunk", "chunked"])
def test_teacher_forced_logits_match_transformers(checkpoint, chunks):
    path, hf = checkpoint
    ids = hff.prompts((21,))[0]
    assert hff.teacher_forced_max_diff(path, hf, ids, chunks) < 1e-4


def test_tp2_ranks_compute_the_transformers_logits(checkpoint):
    path, hf = checkpoint
    ids = hff.prompts((13,))[0]
    ref = hff.hf_logits(hf, ids)
    for logits in hff.rank_logits(path, 2, ids, [8, 5]):
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.fixture(scope="module")
def reference(checkpoint):
    _, hf = checkpoint
    ps = hff.prompts()
    return ps, [hff.hf_generate(hf, p) for p in ps]


@pytest.mark.parametrize("tp_size", [1, 2])
def test_greedy_tokens_equal_transformers_generate(checkpoint, reference, tp_size):
    path, _ = checkpoint
    ps, ref = reference
    assert hff.engine_greedy(hff.make_engine(path, tp_size), ps) == ref


@pytest.mark.parametrize("mode", hff.MODES)
def test_forced_retraction_every_3_steps_keeps_transformers_tokens(checkpoint, reference, mode):
    path, _ = checkpoint
    ps, ref = reference
    e = hff.make_engine(path, 2, forced_retraction_interval=3, retraction_backup=mode)
    assert hff.engine_greedy(e, ps) == ref
    s = e.stats.summary()
    assert s["retractions"] >= 3 and s["checksum_failures"] == 0 and s["restore_fallbacks"] == 0, s
