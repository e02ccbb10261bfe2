"""Qwen3-Next's Gated DeltaNet state enters as two declared slot components (gdn_conv,
gdn_state), sharded by value heads across TP ranks, and the generic backup/restore machinery
carries it: a backup that leaves gdn_state out is caught by verification (and falls back to
recompute, keeping the tokens), and without verification it changes the tokens — so the
component really is state the output depends on. (Logits and greedy tokens against
transformers: test_models_checkpoints.py.)"""
from __future__ import annotations

import pytest
import torch

import hf_families as hff
from hyrax.actors.engine.config import UnsafeFaults
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.sharding import TP
from hyrax.actors.model.state import derive_components, has_recurrent_state

transformers = pytest.importorskip("transformers")
from test_models_checkpoints import qwen3_next  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.manual_seed(0)
    hf = hff.randomize_hf_(qwen3_next().eval())
    path = tmp_path_factory.mktemp("qwen3_next")
    hf.save_pretrained(path)
    ps = hff.prompts((13, 21, 30))
    return path, ps, [hff.hf_generate(hf, p) for p in ps]


def test_gated_deltanet_state_is_two_slot_components_sharded_by_value_heads(checkpoint):
    cfg = ModelConfig.from_dir(checkpoint[0])
    full = {c.name: c for c in derive_components(cfg)}
    assert list(full) == ["full_kv", "gdn_conv", "gdn_state"]
    assert full["gdn_conv"].layers == full["gdn_state"].layers == (0, 1, 3)
    assert full["gdn_conv"].unit_shape == (2 * 32 + 64, 3)  # [q | k | v] channels, kernel - 1
    assert full["gdn_state"].unit_shape == (4, 16, 16) and full["gdn_state"].dtype == torch.float32
    assert has_recurrent_state(tuple(full.values()))
    ranks = [{c.name: c for c in derive_components(cfg, TP(r, 2))} for r in range(2)]
    assert [r["gdn_state"].shard_index for r in ranks] == [(0, 1), (2, 3)]
    conv = [set(r["gdn_conv"].shard_index) for r in ranks]
    assert conv[0].isdisjoint(conv[1]) and conv[0] | conv[1] == set(range(128))


def _run(path, ps, **faults):
    e = hff.make_engine(path, 2, forced_retraction_interval=3, retraction_backup="cpu_tensor",
                        faults=UnsafeFaults(**faults), allow_unsafe=True)
    return hff.engine_greedy(e, ps), e.stats.summary()


def test_backup_without_gdn_state_is_caught_and_recomputed(checkpoint):
    path, ps, ref = checkpoint
    out, s = _run(path, ps, skip_backup_component="gdn_state")
    assert s["restore_fallbacks"] > 0, s
    assert out == ref


def test_backup_without_gdn_state_changes_tokens_when_unverified(checkpoint):
    path, ps, ref = checkpoint
    out, s = _run(path, ps, skip_backup_component="gdn_state", disable_verification=True)
    assert s["retractions"] >= 3, s
    assert out != ref


def test_bf16_gated_deltanet_keeps_its_decay_parameters_in_float32(checkpoint):
    """A bf16 Qwen3-Next keeps each value head's A_log and dt_bias exactly as the checkpoint
    stores them (float32): the decay exp(A_log) * softplus(a + dt_bias) compounds per token."""
    from hyrax.actors.model.loader import load_model

    ref, low = load_model(checkpoint[0], dtype=torch.float32), load_model(checkpoint[0], dtype=torch.bfloat16)
    layers = [(r, lo) for r, lo in zip(ref.model.layers, low.model.layers) if hasattr(r, "linear_attn")]
    assert layers
    for r, lo in layers:
        for name in ("A_log", "dt_bias"):
            got, want = getattr(lo.linear_attn, name), getattr(r.linear_attn, name)
            assert got.dtype == torch.float32 and torch.equal(got, want), name
