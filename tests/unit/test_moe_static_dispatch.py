"""The MoE layer's static dispatch (moe.py; what a CUDA graph captures of a decode step) against
its sparse dispatch, on tiny checkpoints of each expert layout: per layer, the same output up to
summation order and not one host read (hyrax.testing.sync_counter); end to end, an engine whose
decode steps run the static dispatch (as CudaGraphDecode's `captured` does, without the graph)
decodes the greedy tokens of one that does not."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import greedy, make_engine, make_prompts, run_requests
from hyrax.actors.model.captured_decode import CapturedDecode
from hyrax.actors.model.loader import load_model
from hyrax.actors.model.moe import CaptureSafe, moe_layers, static_dispatch
from hyrax.testing.sync_counter import SyncCounter

pytest.importorskip("transformers")
from test_family_config_variants import granite, nemotron_h, qwen3_next, save  # noqa: E402

# Every router and both expert layouts, top-k > 1, a shared expert in each but NemotronH's
# second variant. Granite: stacked experts, topk_softmax; NemotronH: one relu^2 module per
# expert, grouped sigmoid routing; Qwen3-Next: SwiGLU modules, softmax_topk, a gated shared expert.
BUILDS = {
    "granite_stacked": lambda: granite(num_local_experts=6, num_experts_per_tok=3),
    "nemotron_h_grouped": lambda: nemotron_h(n_routed_experts=8, num_experts_per_tok=3, n_group=2, topk_group=1),
    "qwen3_next_gated_shared": lambda: qwen3_next(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=32,
                                                  shared_expert_intermediate_size=48, norm_topk_prob=True),
}


@pytest.fixture(scope="module", params=list(BUILDS))
def moe_dir(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    save(BUILDS[request.param](), path)
    return path


def test_static_dispatch_gives_the_sparse_output_without_host_reads(moe_dir):
    model = load_model(moe_dir, dtype=torch.float32)
    layers = moe_layers(model)
    assert layers and all(m.moe.top_k > 1 for m in layers)
    g = torch.Generator().manual_seed(1)
    for layer in layers:
        x = torch.randn(7, 1, model.cfg.hidden_size, generator=g)  # a decode batch: 7 sequences, 1 token
        chosen = layer.router(x.view(7, -1))[1]
        assert chosen.unique().numel() > layer.moe.top_k  # the batch routes to several experts
        sparse = layer(x)
        counter = SyncCounter([*model.parameters(), *model.buffers(), x])
        with static_dispatch([layer]):
            dense = counter.wrap(layer)(x)
        assert not layer.static_dispatch
        assert not counter.calls[-1].events, "\n" + counter.calls[-1].table()
        torch.testing.assert_close(dense, sparse)


def _greedy_tokens(moe_dir, static_decode: bool) -> list[list[int]]:
    """Ten requests batched (not deterministic mode: decode batches hold several sequences),
    with a retraction every fourth step; with `static_decode`, decode-only steps run the MoE
    layers in static dispatch and prefill the sparse one, as under CudaGraphDecode."""
    model = load_model(moe_dir, dtype=torch.float32)
    if static_decode:
        model.forward = CapturedDecode(model.forward, CaptureSafe(model, model.forward))
    engine = make_engine(model, deterministic=False, forced_retraction_interval=4)
    vocab = model.cfg.vocab_size
    prompts = [[t % vocab for t in p] for p in make_prompts(10, seed=2)]
    return run_requests(engine, prompts, greedy(max_tokens=12))


def test_engine_decodes_the_same_greedy_tokens_with_the_static_dispatch(moe_dir):
    sparse = _greedy_tokens(moe_dir, static_decode=False)
    assert len({tuple(t) for t in sparse}) > 1
    assert _greedy_tokens(moe_dir, static_decode=True) == sparse
