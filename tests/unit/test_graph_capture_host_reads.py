"""What a CUDA graph captures of a decode step (cuda_graphs.CudaGraphDecode: the eager forward
over the graph's static batch) must never make the host wait for the device: a capture fails
on a host read of a device value (`.item()`, `.tolist()`, `bool(t)`), on an op whose output
size depends on values (`nonzero`, a boolean mask index, one-argument `where`), and on a copy
from host memory (which would replay the captured bytes, not the step's). Checked on the CPU
with the device stand-in of tests/unit/test_host_syncs.py (hyrax.testing.sync_counter), on the
path a CUDA rank runs: SDPA attention, the torch Mamba2 step (the C kernels are CPU-only), no
in-place row stepping (it reads slot ids on the host).

Every dense family's layer kinds are covered, and models with routed experts under each router,
whose layers CudaGraphDecode runs in their static dispatch (moe.py). The control is the same
MoE model through its own forward: the sparse dispatch reads the chosen experts on the host."""
from __future__ import annotations

import pytest
import torch

from tiny_models import PAGE_SIZE, random_model
from hyrax.actors.engine.pools import allocate_device_pools, pool_sizes
from hyrax.actors.model.attn_backends import SdpaPaged
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.captured_decode import layer_views
from hyrax.actors.model.config import GdnConfig, ModelConfig, MoeConfig, Multipliers
from hyrax.actors.model.cuda_graphs import (SCRATCH_UNITS, CudaGraphDecode, _clone, batch_tensors, graph_inputs,
                                            scratch_rows)
from hyrax.testing.sync_counter import Counts, SyncCounter

COMMON = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2, mamba_d_conv=4,
              mamba_chunk_size=4)

CONFIGS = {
    # Bamba-like: full and sliding-window attention, Mamba2 with its gated group norm
    "attention_swa_mamba2": dict(layer_types=("full_attention", "mamba2", "sliding_attention", "mamba2"),
                                 sliding_window=5),
    # Falcon-H1-like: attention and Mamba2 side by side, µP multipliers (in_proj sections too),
    # the norm before the gate
    "parallel_mixers_mup": dict(layer_types=("attention_mamba2", "attention_mamba2"), mamba_norm="norm_then_gate",
                                mup=Multipliers(attention_in=0.5, attention_out=1.5, key=0.7, ssm_in=0.8, ssm_out=1.2,
                                                ssm_sections=(1.1, 0.9, 1.2, 0.8, 1.3), mlp_gate=0.6, mlp_down=1.4),
                                embedding_multiplier=2.0, logits_multiplier=0.5, residual_multiplier=0.9),
    # Qwen3-Next-like, dense: Gated DeltaNet, gated attention with q/k norms, zero-centred norms
    "gated_deltanet_gated_attention": dict(layer_types=("gated_deltanet", "full_attention"), attn_output_gate=True,
                                           qk_norm=True, norm_offset=1.0,
                                           gdn=GdnConfig(num_k_heads=2, num_v_heads=4, k_head_dim=8, v_head_dim=8,
                                                         conv_kernel=4)),
    # NemotronH-like, dense: a layer without mixer, relu^2 MLPs, no norm weight on Mamba2's gate
    "mixerless_relu2_nope": dict(layer_types=("mamba2", "ffn_only", "full_attention"),
                                 ffn_types=("none", "relu2", "relu2"), mamba_norm="gate_only", use_rope=False),
}
MOE = dict(layer_types=("mamba2", "full_attention"), ffn_types=("moe", "moe"),
           moe=MoeConfig(num_experts=4, top_k=2, intermediate_size=16, shared_intermediate_size=16,
                         router="topk_softmax"))
MOE_CONFIGS = {
    "topk_softmax_shared": MOE,
    # Qwen-like: softmax over all experts, renormalised top-k, a gated shared expert
    "softmax_topk_gated_shared": dict(MOE, moe=MoeConfig(num_experts=6, top_k=3, intermediate_size=16,
                                                          shared_intermediate_size=16, router="softmax_topk",
                                                          norm_topk_prob=True, shared_expert_gate=True)),
    # NemotronH-like: grouped sigmoid routing with correction bias, relu^2 experts, no shared expert
    "sigmoid_grouped_relu2": dict(MOE, moe=MoeConfig(num_experts=8, top_k=2, intermediate_size=16,
                                                     shared_intermediate_size=0, router="sigmoid_grouped",
                                                     gated_experts=False, norm_topk_prob=True,
                                                     routed_scaling_factor=2.5, n_group=2, topk_group=1)),
}


def _as_cuda_runs(model):
    """The model on the path a CUDA rank takes through its decode forward."""
    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.backend = SdpaPaged()
        if hasattr(layer, "mamba"):
            layer.mamba.native_kernels = layer.mamba.native_step = layer.mamba.rows_in_place = False
    return model


def _captured_forward_counts(cfg: dict, captured: bool = True) -> Counts:
    """The events of the forward a graph captures (`CudaGraphDecode.captured`; with `captured`
    False the model's own forward), for a decode batch of 3 padded to 4 rows. It runs once first
    over another copy of the batch (as `warm_up` does before a capture: lazy caches fill there),
    then counted over fresh static copies, as the capture runs it. (CudaGraphDecode is built on
    a CUDA device name; its constructor allocates nothing.)"""
    model = _as_cuda_runs(random_model(ModelConfig(**{**COMMON, **cfg}), dtype=torch.float32))
    comps = model.components
    names = tuple(c.name for c in comps)
    forward = CudaGraphDecode(model, model.forward, names, torch.device("cuda")).captured if captured else model
    paged = frozenset(c.name for c in comps if c.paged)
    pools = allocate_device_pools(comps, pool_sizes(comps, PAGE_SIZE, 256, 8, scratch=SCRATCH_UNITS))
    g = torch.Generator().manual_seed(0)
    for p in pools.values():
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.3)
    seqs = [SeqSlice([5 + i], ctx - 1, {c.name: list(range(10 * i, 10 * i + -(-ctx // PAGE_SIZE))) for c in comps
                                         if c.paged}, {c.name: i for c in comps if not c.paged})
            for i, ctx in enumerate([9, 20, 3])]
    batch = build_forward_batch(seqs, comps, PAGE_SIZE)
    _, padded = graph_inputs(batch, scratch_rows(pools, names, PAGE_SIZE, paged))
    forward(_clone(padded), layer_views(pools, names))  # the warm-up
    static = _clone(padded)
    counter = SyncCounter([*model.parameters(), *model.buffers(), *pools.values(), *batch_tensors(static)])
    logits = counter.wrap(lambda: forward(static, layer_views(pools, names)))()
    assert logits.shape == (4, model.cfg.vocab_size) and torch.isfinite(logits).all()
    return counter.calls[-1]


@pytest.mark.parametrize("cfg", list(CONFIGS.values()), ids=list(CONFIGS))
def test_the_captured_decode_forward_never_waits_for_the_device(cfg):
    counts = _captured_forward_counts(cfg)
    assert not counts.events, "\n" + counts.table()


@pytest.mark.parametrize("cfg", list(MOE_CONFIGS.values()), ids=list(MOE_CONFIGS))
def test_routed_experts_in_static_dispatch_never_wait_for_the_device(cfg):
    counts = _captured_forward_counts(cfg)
    assert not counts.events, "\n" + counts.table()


def test_the_sparse_expert_dispatch_reads_the_device():
    """The control: the model's own forward (prefill, eager decode) keeps the sparse dispatch,
    whose reads the counter sees."""
    counts = _captured_forward_counts(MOE, captured=False)
    assert counts.syncs, "the sparse dispatch read nothing on the host"
    assert any(e.where.startswith("hyrax/actors/model/moe.py") for e in counts.events), counts.table()
