"""Captured decode steps (hyrax/actors/model/captured_decode.py): torch.compile'd decode steps
give the eager run's greedy tokens across changing batch sizes and retraction/resume and write
the engine's own pools in place; the key padding both captured paths apply changes nothing
(checked through the eager forward, so the CUDA-graph path's padding is checked here too).

The compiled model is built once per backend: "aot_eager" (dynamo's graph, functionalised,
run by torch ops) and "inductor" (what `--captured-decode compile` runs, C++ kernel builds
included: ~65 s for this module's inductor tests on the 2-core VM with an empty inductor cache,
2026-12-06; it was ~6 min, marked slow, before the decode forward compiled as whole graphs)."""
from __future__ import annotations

import copy

import pytest
import torch

from engine_helpers import HYBRID, greedy, make_engine, make_prompts, run_requests, tiny_model
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.captured_decode import CapturedDecode, CompiledDecode, capture_decode, pad_key_columns
from hyrax.actors.model.errors import HyraxInputError


class Counting:
    """Records how many decode batches (and of which sizes) went through the captured path."""

    def __init__(self, inner):
        self.inner, self.sizes = inner, []

    def __call__(self, batch, pools):
        self.sizes.append(batch.num_seqs)
        return self.inner(batch, pools)


@pytest.fixture(scope="module", params=["aot_eager", "inductor"])
def compiled(request):
    """A copy of the shared tiny hybrid model (full + sliding attention + Mamba2) whose decode
    steps go through torch.compile, with a recorder on the captured path."""
    model = copy.deepcopy(tiny_model(HYBRID))
    eager = model.forward
    names = tuple(c.name for c in model.components)
    model.forward = CapturedDecode(eager, Counting(CompiledDecode(eager, names, backend=request.param)))
    torch._dynamo.utils.counters.clear()  # graph breaks are counted from here (no_graph_breaks)
    return model


def no_graph_breaks() -> None:
    """The decode forward compiled as whole graphs: a graph break anywhere in it (an op dynamo
    cannot trace, inside the layer loop) drops the whole forward to eager, frame by frame, with
    a recompile per layer, while the tokens stay right - the tests above would still pass."""
    breaks = dict(torch._dynamo.utils.counters["graph_break"])
    assert not breaks, breaks


def test_compiled_decode_matches_eager_tokens_across_batch_sizes_and_retraction(compiled):
    """Batched (not deterministic: that mode runs each request alone), a retraction every 3
    steps; the eager run has the same schedule, so the same batches."""
    prompts = make_prompts(9, seed=3)
    runs = {}
    for name, model in (("eager", tiny_model(HYBRID)), ("compiled", compiled)):
        e = make_engine(model, forced_retraction_interval=3, deterministic=False)
        runs[name] = run_requests(e, prompts, greedy())
        assert e.stats.summary()["retractions"] >= 3
    assert runs["compiled"] == runs["eager"]
    sizes = set(compiled.forward.decode.sizes)
    assert len(sizes) >= 3 and 1 in sizes and max(sizes) >= 4, sizes  # sizes crossed, B == 1 included
    no_graph_breaks()
    # one graph for B == 1, one for every B >= 2, one more for steps whose slots come strided (a
    # decode block's columns): a tensor whose batch dimension was left static adds one per size
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 3, dict(torch._dynamo.utils.counters["stats"])


def test_compiled_decode_writes_the_engine_pools_in_place(compiled):
    e = make_engine(compiled, overlap=False, deterministic=False)
    for p in make_prompts(3, seed=5):
        e.add_request(p, greedy(6))
    while not all(len(r.output_ids) >= 2 for r in e.requests.values()):
        e.step()
    rank = e.executor.rank
    held = dict(rank.pools)  # the tensors the engine holds
    before = {n: t.clone() for n, t in held.items()}
    calls = len(compiled.forward.decode.sizes)
    eager_pools = {n: t.clone() for n, t in held.items()}
    calls_in = []  # (decode block, entries, captures, fills) of each forward
    inner = rank._forward
    rank._forward = lambda *args: (calls_in.append(args), inner(*args))[1]
    e.step()
    rank._forward = inner
    assert len(compiled.forward.decode.sizes) == calls + 1  # the step went through the captured path
    assert all(rank.pools[n] is held[n] for n in held)
    block, entries, captures, fills = calls_in[-1]
    batch = build_forward_batch(entries, rank.components, rank.sizes.page_size, captures=captures, fills=fills,
                                block=block)
    compiled.forward.eager(batch, eager_pools)  # the same step, eager, on a copy of the old state
    for name in ("full_kv", "swa_kv", "mamba_conv", "mamba_ssm"):
        assert not torch.equal(held[name], before[name]), name  # the captured step wrote into it
        torch.testing.assert_close(held[name], eager_pools[name], rtol=1e-5, atol=1e-5, msg=name)


def _decode_batch(model):
    """A decode batch of 3 sequences (slots 1, 4, 6 of 8; pages 0-5 of 8, 4 rows each) and
    pools of random state (seeded: the same numbers whatever ran before)."""
    comps = model.components
    g = torch.Generator().manual_seed(11)
    pools = {c.name: torch.randn(len(c.layers), 32 if c.paged else 8, *c.unit_shape, generator=g) for c in comps}
    seqs = []
    for i, (slot, start) in enumerate(((1, 5), (4, 7), (6, 2))):
        tables = {c.name: [2 * i, 2 * i + 1] for c in comps if c.paged}
        seqs.append(SeqSlice([3 + i], start, tables, {c.name: slot for c in comps if not c.paged}))
    return build_forward_batch(seqs, comps, 4), pools


@pytest.mark.parametrize("extra", [1, 40])
def test_key_padding_gives_the_same_logits_and_state(extra):
    """The padding both captured paths apply (CPU: one column, CUDA: a power-of-two bucket),
    through the eager forward: same logits, same pools, padding keys never read."""
    model = tiny_model(HYBRID)
    batch, pools = _decode_batch(model)
    keys = {n: i.read_rows.shape[1] + extra for n, i in batch.attn.items()}
    padded = pad_key_columns(batch, keys)
    for n, i in padded.attn.items():
        assert i.read_rows.shape[1] == keys[n] and i.pad_keys.shape == (3 * keys[n],)
        assert not i.key_valid.view(-1)[i.pad_keys].any()  # every listed key is invalid
        assert (~i.key_valid).sum() == len(set(i.pad_keys.tolist()))  # and every invalid key is listed
    padded_pools = {n: t.clone() for n, t in pools.items()}
    # float32 through attention over a different number of key columns: sums in another order
    # (up to ~4e-5 on logits of ~6 over 200 random pools); a padding key read changes them by ~1
    torch.testing.assert_close(model(padded, padded_pools), model(batch, pools), rtol=1e-4, atol=1e-4)
    for n in pools:
        torch.testing.assert_close(padded_pools[n], pools[n], rtol=1e-4, atol=1e-4, msg=n)
    with pytest.raises(ValueError, match="does not pass K"):
        pad_key_columns(batch, {n: i.read_rows.shape[1] for n, i in batch.attn.items()})


def test_engine_config_captures_its_model_once():
    model = copy.deepcopy(tiny_model(HYBRID))
    make_engine(model, captured_decode="compile")  # compiles lazily: nothing runs here
    assert isinstance(model.forward, CapturedDecode) and isinstance(model.forward.decode, CompiledDecode)
    with pytest.raises(ValueError, match="captured already"):
        make_engine(model, captured_decode="compile")


def test_captured_decode_mode_is_validated():
    with pytest.raises(HyraxInputError, match="captured-decode must be one of off, compile, cuda_graphs, got 'yes'"):
        EngineConfig(captured_decode="yes")
    with pytest.raises(HyraxInputError, match="^--captured-decode cuda_graphs needs a CUDA device; this rank runs on cpu"):
        capture_decode(copy.deepcopy(tiny_model(HYBRID)), "cuda_graphs", "cpu")


# (kernel module, its traced operator, the function the operator calls): the C kernels the eager
# decode step runs, which a compiled one runs as operators of its graph
TRACED_KERNELS = {"attention": ("paged_decode", "traced_paged_decode", "paged_decode"),
                  "mamba2": ("mamba2_rows", "traced_mamba2_decode", "mamba2_decode_rows_")}


@pytest.mark.parametrize("kernel", TRACED_KERNELS)
def test_compiled_decode_calls_the_c_kernels(compiled, monkeypatch, kernel):
    """Traced, decode attention and the Mamba2 step go through their C kernels, each as one
    operator (`hyrax::paged_decode`, `hyrax::mamba2_decode`; traced_ops.py), as the eager decode
    step does, rather than through the torch path traced in their place."""
    import importlib

    module_name, op_name, function_name = TRACED_KERNELS[kernel]
    kernel_module = importlib.import_module(f"hyrax.actors.model.{module_name}")
    if kernel_module.available() is not None or getattr(kernel_module, op_name) is None:
        pytest.skip(f"no C {kernel} kernel or operator here: {kernel_module.available()}")
    calls = []
    inner = getattr(kernel_module, function_name)
    monkeypatch.setattr(kernel_module, function_name, lambda *a: (calls.append(a[0].shape[0]), inner(*a))[1])
    e = make_engine(compiled, overlap=False, deterministic=False)
    for p in make_prompts(3, seed=7):
        e.add_request(p, greedy(4))
    decoded = len(compiled.forward.decode.sizes)
    while e.has_unfinished():
        e.step()
    assert len(compiled.forward.decode.sizes) > decoded  # decode steps went through the compiled path
    assert calls and set(calls) <= set(compiled.forward.decode.sizes)  # ... and called the kernel, once per layer
    no_graph_breaks()


def test_compiled_decode_without_the_mamba2_operator_traces_the_torch_step(monkeypatch):
    """Where this torch compiles an operator's writes into pool views wrong (traced_ops:
    WRITES_INTO_INPUT_VIEWS; torch 2.4-2.6), hyrax::mamba2_decode is not defined and the compiled
    step traces the Mamba2 layer's torch path: the eager step's logits and state."""
    import hyrax.actors.model.mamba2 as mamba2

    monkeypatch.setattr(mamba2, "traced_mamba2_decode", None)
    model = copy.deepcopy(tiny_model(HYBRID))
    batch, pools = _decode_batch(model)
    eager_pools = {n: t.clone() for n, t in pools.items()}
    want = model(batch, eager_pools)
    got = CompiledDecode(model.forward, tuple(c.name for c in model.components), backend="aot_eager")(batch, pools)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for n in pools:
        torch.testing.assert_close(pools[n], eager_pools[n], rtol=1e-5, atol=1e-5, msg=n)


def _flushes_denormals() -> bool:
    return bool((torch.tensor([1e-40]) * 1.0 == 0).item())  # 1e-40: a float32 denormal


def test_a_compiled_step_that_turns_on_flush_to_zero_leaves_it_off():
    """torch < 2.6's inductor kernels (-ffast-math, gcc < 13) turn on flush-to-zero in the thread
    that loads them: after a compiled step, the thread's eager ops and C kernels would compute
    denormals as 0 (the native silu's accuracy test failed after this module). Simulated: a
    compiled forward that turns it on."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode to set")
    model = tiny_model(HYBRID)
    decode = CompiledDecode(model.forward, tuple(c.name for c in model.components), backend="aot_eager")
    decode.compiled = lambda batch, pools: (torch.set_flush_denormal(True), model(batch, pools))[1]
    try:
        decode(*_decode_batch(model))
        assert not _flushes_denormals()
    finally:
        torch.set_flush_denormal(False)


def test_compiled_decode_leaves_denormals_to_the_threads_later_ops(compiled):
    """The same with this torch's own compiled step (inductor's kernels built and loaded)."""
    e = make_engine(compiled, overlap=False, deterministic=False)
    e.add_request(make_prompts(1, seed=9)[0], greedy(3))
    while e.has_unfinished():
        e.step()
    assert not _flushes_denormals()
