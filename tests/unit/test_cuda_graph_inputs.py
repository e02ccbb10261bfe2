"""What a CUDA graph of a decode step is keyed and fed by (hyrax/actors/model/cuda_graphs.py),
checked on the CPU: replaying a graph copies a step's tensors into the graph's static buffers,
so every tensor it copies must have the shape the graph was captured with whenever two steps
get the same graph. The capture and replay themselves need CUDA (tests/gpu)."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import HYBRID, tiny_model
from hyrax.actors.model.attn_backends import SdpaPaged
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.captured_decode import layer_views
from hyrax.actors.model.cuda_graphs import _clone, batch_tensors, graph_inputs, pool_layout, warm_up

PAGE = 4


def _decode(model, contexts: list[int]):
    """A decode batch: one token per sequence at position ctx - 1, each sequence on pages of its
    own, as many as its context needs."""
    comps = model.components
    seqs = []
    for i, ctx in enumerate(contexts):
        pages = -(-ctx // PAGE)
        tables = {c.name: list(range(10 * i, 10 * i + pages)) for c in comps if c.paged}
        seqs.append(SeqSlice([3], ctx - 1, tables, {c.name: i for c in comps if not c.paged}))
    return build_forward_batch(seqs, comps, PAGE)


@pytest.mark.parametrize("before, after", [([9, 20], [10, 21]), ([5], [40]), ([33, 2, 17], [36, 5, 20])],
                         ids=["next step crosses a page", "same bucket far apart", "three sequences"])
def test_steps_that_share_a_graph_feed_it_tensors_of_its_shapes(before, after):
    model = tiny_model(HYBRID)
    key_a, a = graph_inputs(_decode(model, before))
    key_b, b = graph_inputs(_decode(model, after))
    assert key_a == key_b  # the same graph replays both steps
    shapes_a = [tuple(t.shape) for t in batch_tensors(a)]
    shapes_b = [tuple(t.shape) for t in batch_tensors(b)]
    assert shapes_a == shapes_b


def test_a_longer_context_past_the_bucket_gets_another_graph():
    model = tiny_model(HYBRID)
    key_a, _ = graph_inputs(_decode(model, [9, 20]))
    key_b, _ = graph_inputs(_decode(model, [9, 300]))
    assert key_a != key_b


def test_the_batch_a_graph_holds_runs_the_decode_forward_to_the_eager_logits():
    """The graph's copy of a step (`_clone`: per-key tensors only, no page table, no key layout)
    is what the warm-up runs and the capture records: through the SDPA decode path it gives the
    eager step's logits, so nothing the graph leaves out is read."""
    torch.manual_seed(0)
    model = tiny_model(HYBRID)
    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.backend = SdpaPaged()
    batch = _decode(model, [9, 20, 3])
    pools = {c.name: torch.randn(len(c.layers), 512 if c.paged else 8, *c.unit_shape) for c in model.components}
    held = _clone(graph_inputs(batch)[1])
    assert all(i.page_table.numel() == 0 and i.keys is None for i in held.attn.values())
    mine = {n: p.clone() for n, p in pools.items()}
    torch.testing.assert_close(model(held, layer_views(mine, tuple(pools))), model(batch, pools), rtol=1e-4, atol=1e-4)
    for n in pools:
        torch.testing.assert_close(mine[n], pools[n], rtol=1e-5, atol=1e-5, msg=n)


def test_pools_at_the_same_address_with_another_shape_get_another_graph():
    """The profile's throw-away pools and the engine's may share an address (the allocator reuses
    freed blocks); per-layer offsets differ with the row count, so the graph must differ too."""
    memory = torch.zeros(4 * 64 * 8)
    profile = {"full_kv": memory[:2 * 32 * 8].view(2, 32, 8)}
    engine = {"full_kv": memory.view(2, 128, 8)}
    assert profile["full_kv"].data_ptr() == engine["full_kv"].data_ptr()
    assert pool_layout(profile, ("full_kv",)) != pool_layout(engine, ("full_kv",))
    assert pool_layout(engine, ("full_kv",)) == pool_layout({"full_kv": memory.view(2, 128, 8)}, ("full_kv",))


def test_the_warm_up_before_a_capture_leaves_the_pools_state_as_it_was():
    """Capture needs warm-up runs of the forward. They run over the real pools (clones of pools
    sized to fill the GPU do not fit beside them), so they must not advance the batch's state:
    the step run after them gives the logits and pools of the same step run without them."""
    torch.manual_seed(0)
    model = tiny_model(HYBRID)
    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.backend = SdpaPaged()
    names = tuple(c.name for c in model.components)
    batch = _decode(model, [9, 20, 3])
    padded = graph_inputs(batch)[1]
    pools = {c.name: torch.randn(len(c.layers), 512 if c.paged else 8, *c.unit_shape) for c in model.components}
    untouched = {n: p.clone() for n, p in pools.items()}
    warm_up(lambda b, views: model(b, views), padded, pools, names)
    assert any(c.name in batch.slots for c in model.components if not c.paged)
    for c in model.components:
        if not c.paged:  # the recurrent state: put back as it was
            assert torch.equal(pools[c.name], untouched[c.name]), c.name
    want = model(batch, untouched)
    torch.testing.assert_close(model(batch, pools), want, rtol=0, atol=0)
    for n in pools:  # the step wrote the warm-up's rows again
        assert torch.equal(pools[n], untouched[n]), n
