"""The vllm_flash_attn kernel against SDPA on the same GPU (skipped without CUDA or without
the `gpu` extra): one attention layer over a packed paged step, and whole greedy runs with
forced retraction. The CPU suite checks the adapter's arguments against a reference of the
kernel's semantics (tests/unit/test_attention_paged.py); this checks the kernel itself."""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import demo_greedy
from hyrax.actors.engine.pools import allocate_device_pools, pool_sizes
from hyrax.actors.model.attn_backends import FlashPaged, SdpaPaged, select_backend
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.hybrid import HybridModel

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module", autouse=True)
def flash_available():
    if not isinstance(select_backend("auto", "cuda", torch.bfloat16, 64), FlashPaged):
        pytest.skip("vllm_flash_attn does not import here (pip install '.[gpu]' with torch 2.4)")


CFG = ModelConfig(
    vocab_size=128, hidden_size=256, intermediate_size=256,
    layer_types=("full_attention", "sliding_attention"), num_attention_heads=8, num_key_value_heads=2,
    head_dim=64, sliding_window=24, max_position_embeddings=1024,
)


@pytest.mark.parametrize("layer", [0, 1], ids=["full", "sliding"])
def test_one_packed_paged_step_matches_sdpa(layer):
    torch.manual_seed(0)
    model = HybridModel(CFG, dtype=torch.bfloat16, device="cuda").cuda()
    for p in model.parameters():
        p.data.normal_(0, 0.05)
    attn = model.model.layers[layer].self_attn
    assert attn.backend.name == "vllm_flash_attn"
    comps = model.components
    pools = allocate_device_pools(comps, pool_sizes(comps, 16, 4096, 4), "cuda")
    perm = torch.randperm(256).tolist()
    # three requests: a long prefill chunk, a decode token deep into its context, a short prefill
    starts, lens = [0, 70, 0], [100, 1, 7]
    seqs = [SeqSlice([1] * n, s, {c.name: perm[i * 10:(i + 1) * 10] for c in comps}, {})
            for i, (s, n) in enumerate(zip(starts, lens))]
    # earlier context of request 1: write its first 70 tokens' K/V through one step first
    ctx = [SeqSlice([1] * 70, 0, seqs[1].page_tables, {})]
    batch0 = build_forward_batch(ctx, comps, 16, "cuda")
    x0 = torch.randn(1, 70, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    cs0 = model.rope.cos_sin(batch0.positions)
    attn(x0, batch0, pools, model.rope, cs0)
    batch = build_forward_batch(seqs, comps, 16, "cuda")
    x = torch.randn(3, batch.max_len, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    cs = model.rope.cos_sin(batch.positions)
    flash_out = attn(x, batch, {k: v.clone() for k, v in pools.items()}, model.rope, cs)
    attn.backend = SdpaPaged()
    sdpa_out = attn(x, batch, {k: v.clone() for k, v in pools.items()}, model.rope, cs)
    valid = batch.q_valid
    torch.testing.assert_close(flash_out[valid].float(), sdpa_out[valid].float(), atol=2e-2, rtol=2e-2)


def _greedy(backend: str, **kw):
    return demo_greedy("cuda", (5, 40, 130, 77, 300), dtype="bfloat16", attention_backend=backend, **kw)


def test_engine_with_flash_matches_sdpa_and_survives_forced_retraction():
    sdpa, _ = _greedy("sdpa")
    flash, _ = _greedy("vllm_flash_attn")
    same = sum(a == b for a, b in zip(sdpa, flash))
    assert same >= len(sdpa) - 1, (sdpa, flash)  # bf16 kernels may flip one near-tie
    retracted, stats = _greedy("vllm_flash_attn", forced_retraction_interval=3)
    assert retracted == flash
    assert stats["restores_by"].get("verified", 0) > 0 and stats["restore_fallbacks"] == 0
