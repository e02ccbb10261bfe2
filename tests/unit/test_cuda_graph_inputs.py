"""What a CUDA graph of a decode step is keyed and fed by (hyrax/actors/model/cuda_graphs.py),
checked on the CPU: replaying a graph copies a step's tensors into the graph's static buffers,
so every tensor it copies must have the shape the graph was captured with whenever two steps
get the same graph. The capture and replay themselves need CUDA (tests/gpu)."""
from __future__ import annotations

import copy

import pytest
import torch

from engine_helpers import HYBRID, tiny_model
from hyrax.actors.model.attn_backends import SdpaPaged
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.captured_decode import layer_views
from hyrax.actors.model.cuda_graphs import (_clone, batch_bucket, batch_tensors, graph_inputs, pool_layout,
                                           scratch_rows, warm_up)

PAGE = 4
ROWS, SLOTS = 512, 8  # the pools' capacity: K/V rows, recurrent slots
SCRATCH = {"full_kv": ROWS, "swa_kv": ROWS, "mamba_conv": SLOTS, "mamba_ssm": SLOTS}  # the scratch unit's row


def _sdpa_model():
    """The model as a CUDA-graph rank runs it: SDPA attention and the torch Mamba2 step (the C
    kernels are CPU-only; they refuse two sequences on one state row, which padding rows are).
    A copy: `tiny_model` is cached and shared with every other test of the process."""
    model = copy.deepcopy(tiny_model(HYBRID))
    for layer in model.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.backend = SdpaPaged()
        if hasattr(layer, "mamba"):
            layer.mamba.native_kernels = layer.mamba.native_step = False
    return model


def _pools(model) -> dict[str, torch.Tensor]:
    """Random pools of ROWS / SLOTS rows, each with its scratch unit after them (a page, a slot),
    as engine/pools.py builds them for graphs."""
    pools = {c.name: torch.randn(len(c.layers), ROWS + PAGE if c.paged else SLOTS + 1, *c.unit_shape)
             for c in model.components}
    assert scratch_rows(pools, tuple(pools), PAGE, frozenset(c.name for c in model.components if c.paged)) == SCRATCH
    return pools


def _owned(pool: torch.Tensor, name: str) -> torch.Tensor:
    """The rows an allocator hands out: the pool without its scratch unit."""
    return pool[:, :SCRATCH[name]]


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
    key_a, a = graph_inputs(_decode(model, before), SCRATCH)
    key_b, b = graph_inputs(_decode(model, after), SCRATCH)
    assert key_a == key_b  # the same graph replays both steps
    shapes_a = [tuple(t.shape) for t in batch_tensors(a)]
    shapes_b = [tuple(t.shape) for t in batch_tensors(b)]
    assert shapes_a == shapes_b


def test_a_longer_context_past_the_bucket_gets_another_graph():
    model = tiny_model(HYBRID)
    key_a, _ = graph_inputs(_decode(model, [9, 20]), SCRATCH)
    key_b, _ = graph_inputs(_decode(model, [9, 300]), SCRATCH)
    assert key_a != key_b


def test_the_batch_a_graph_holds_runs_the_decode_forward_to_the_eager_logits():
    """The graph's copy of a step (`_clone`: per-key tensors only, no page table, no key layout;
    its rows padded to the bucket) is what the warm-up runs and the capture records: through the
    SDPA decode path its own rows get the eager step's logits and state, so nothing the graph
    leaves out is read, and its padding rows touch only the scratch unit."""
    torch.manual_seed(0)
    model = _sdpa_model()
    batch = _decode(model, [9, 20, 3])
    pools = _pools(model)
    held = _clone(graph_inputs(batch, SCRATCH)[1])
    assert held.num_seqs == 4 and all(i.page_table.numel() == 0 and i.keys is None for i in held.attn.values())
    mine = {n: p.clone() for n, p in pools.items()}
    logits = model(held, layer_views(mine, tuple(pools)))
    torch.testing.assert_close(logits[:3], model(batch, pools), rtol=1e-4, atol=1e-4)
    for n in pools:
        torch.testing.assert_close(_owned(mine[n], n), _owned(pools[n], n), rtol=1e-5, atol=1e-5, msg=n)


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
    model = _sdpa_model()
    names = tuple(c.name for c in model.components)
    batch = _decode(model, [9, 20, 3])
    padded = graph_inputs(batch, SCRATCH)[1]
    pools = _pools(model)
    untouched = {n: p.clone() for n, p in pools.items()}
    warm_up(lambda b, views: model(b, views), padded, pools, names)
    assert any(c.name in batch.slots for c in model.components if not c.paged)
    for c in model.components:
        if not c.paged:  # the recurrent state: put back as it was
            assert torch.equal(pools[c.name], untouched[c.name]), c.name
    want = model(batch, untouched)
    torch.testing.assert_close(model(batch, pools), want, rtol=0, atol=0)
    for n in pools:  # the step wrote the warm-up's rows again (the scratch unit is nobody's)
        assert torch.equal(_owned(pools[n], n), _owned(untouched[n], n)), n


def test_batch_sizes_share_a_graph_per_bucket():
    assert [batch_bucket(b) for b in range(1, 18)] == [1, 2, 4, 4, 8, 8, 8, 8, 16, 16, 16, 16, 16, 16, 16, 16, 24]
    assert len({batch_bucket(b) for b in range(1, 129)}) == 19 and batch_bucket(128) == 128
    model = tiny_model(HYBRID)
    keys = {graph_inputs(_decode(model, [9, 20, 3, 11, 5, 7, 30, 2][:b]), SCRATCH)[0] for b in range(5, 9)}
    assert keys == {(8, 64, 64)}  # batches of 5 to 8 sequences replay one graph


@pytest.mark.parametrize("contexts", [[9, 20, 3], [9, 20, 3, 11, 5], [9]], ids=["3 of 4", "5 of 8", "1 of 1"])
def test_padding_rows_change_only_the_scratch_unit_and_no_row_of_the_batch(contexts):
    """A batch padded to its bucket, through the eager forward: its own rows get the unpadded
    step's logits, every row an allocator hands out ends as the unpadded step leaves it, and
    the padding rows (several share the scratch unit) write only there. Pointed at an owned
    slot instead, they would overwrite that request's recurrent state."""
    torch.manual_seed(0)
    model = _sdpa_model()
    batch = _decode(model, contexts)
    B = len(contexts)
    pools = _pools(model)
    key, padded = graph_inputs(batch, SCRATCH)
    assert padded.num_seqs == key[0] == batch_bucket(B)
    mine = {n: p.clone() for n, p in pools.items()}
    logits = model(padded, mine)
    assert torch.isfinite(logits).all()  # a padding row attends to its one valid key
    torch.testing.assert_close(logits[:B], model(batch, pools), rtol=1e-4, atol=1e-4)
    for n in pools:
        torch.testing.assert_close(_owned(mine[n], n), _owned(pools[n], n), rtol=1e-5, atol=1e-5, msg=n)
    wrote_scratch = any(not torch.equal(mine[n][:, SCRATCH[n]], pools[n][:, SCRATCH[n]]) for n in pools)
    assert wrote_scratch == (padded.num_seqs > B)


def test_pools_built_for_graphs_keep_a_scratch_unit_outside_the_capacity():
    """`--captured-decode cuda_graphs` adds one unit (a page, a slot) to every model pool, past
    what the allocator hands out; the memory check counts it. Other modes add nothing."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.engine import Engine  # noqa: F401  (the allocator's capacity: sizes.units)
    from hyrax.actors.engine.pools import allocate_device_pools, pool_bytes, pool_sizes_for

    comps = tiny_model(HYBRID).components
    plain = EngineConfig(kv_capacity_tokens=64, mamba_slots=3, page_size=PAGE)
    graphs = EngineConfig(kv_capacity_tokens=64, mamba_slots=3, page_size=PAGE, captured_decode="cuda_graphs")
    a, b = pool_sizes_for(comps, plain), pool_sizes_for(comps, graphs)
    assert a.units == b.units and (a.scratch, b.scratch) == (0, 1)
    pa, pb = allocate_device_pools(comps, a), allocate_device_pools(comps, b)
    for c in comps:
        unit = PAGE if c.paged else 1
        assert pa[c.name].shape[1] == a.rows(c) and pb[c.name].shape[1] == b.rows(c) + unit, c.name
    assert pool_bytes(comps, b) == sum(t.numel() * t.element_size() for t in pb.values())
    assert pool_bytes(comps, b) - pool_bytes(comps, a) == sum((PAGE if c.paged else 1) * c.row_bytes for c in comps)


def test_cuda_graphs_capture_a_model_with_routed_experts_in_static_dispatch(tmp_path):
    """The MoE layer's own dispatch reads the experts a step chose on the host, which a capture
    forbids; CudaGraphDecode takes the model and warms up and captures `captured`, which runs
    every MoE layer in the static dispatch (moe.py) for the call. The model's own forward, which
    prefill runs, keeps the sparse dispatch. (Built on a CUDA device name; nothing is allocated
    there, so this runs without CUDA. test_graph_capture_host_reads runs `captured`.)"""
    from test_family_config_variants import granite, save

    from hyrax.actors.model.cuda_graphs import CudaGraphDecode
    from hyrax.actors.model.loader import load_model
    from hyrax.actors.model.moe import MoE

    save(granite(), tmp_path)
    moe = load_model(tmp_path, attn_backend="sdpa")
    assert moe.cfg.moe.num_experts == 4
    decode = CudaGraphDecode(moe, moe.forward, tuple(c.name for c in moe.components), torch.device("cuda"))
    layers = [m for m in moe.modules() if isinstance(m, MoE)]
    assert len(layers) == 2 and decode.captured.layers == layers
    assert decode.captured.forward == moe.forward and decode.eager == moe.forward
    assert not any(m.static_dispatch for m in layers)  # only inside a captured call
    dense = _sdpa_model()
    assert CudaGraphDecode(dense, dense.forward, tuple(c.name for c in dense.components),
                           torch.device("cuda")).captured.layers == []
