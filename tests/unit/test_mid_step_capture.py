"""A recurrent state captured inside a step (batch.Capture; a prefix-cache checkpoint inside a
prefill chunk) equals the state of a run that stopped there: the SSD final-state contraction
against the token-by-token recurrence, and a Mamba2 model's captured conv and SSM rows against
the slots of a run fed only the tokens before the capture point, in a batch of mixed lengths."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.components import captures_mid_step
from hyrax.actors.model.conv import conv_state_after
from hyrax.actors.model.ssd import ssd_sequential, ssd_state_after
from tiny_models import PAGE_SIZE, fresh_pools, random_model, shuffled_pages, slots_for, tiny_config


def test_ssd_state_after_equals_the_recurrence():
    g = torch.Generator().manual_seed(0)
    B, T, H, P, G, N = 3, 11, 4, 5, 2, 6
    x = torch.randn(B, T, H, P, generator=g, dtype=torch.float64)
    dt = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    Bm = torch.randn(B, T, G, N, generator=g, dtype=torch.float64)
    init = torch.randn(B, H, P, N, generator=g, dtype=torch.float64)
    for k in (1, 4, T):
        _, want = ssd_sequential(x[:, :k], dt[:, :k], A, Bm[:, :k], torch.zeros(B, T, G, N, dtype=torch.float64)[:, :k],
                                 torch.zeros(H, dtype=torch.float64), init)
        keep = (torch.arange(T) < k).to(dt.dtype)[None, :, None]
        got = ssd_state_after(x, dt * keep, A, Bm, init)
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_conv_state_after_is_the_last_inputs_up_to_the_point():
    state = torch.arange(3 * 3 * 3, dtype=torch.float32).view(3, 3, 3)  # (n, C, K-1): the points' slots
    x = 100 + torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3)  # (B, T, C)
    got = conv_state_after(state, x, torch.tensor([0, 1, 1]), torch.tensor([1, 4, 2]))  # row 1 twice
    assert torch.equal(got[0], torch.cat([state[0, :, 1:], x[0, :1].t()], dim=1))
    assert torch.equal(got[1], x[1, 1:4].t())
    assert torch.equal(got[2], torch.cat([state[2, :, 2:], x[1, :2].t()], dim=1))


def test_states_at_from_chunk_starts_equal_the_recurrence():
    """ssd_states_at (a chunk's start state advanced inside that chunk) against the plain
    recurrence stopped at each point: at a chunk start, inside a chunk, inside a last partial
    chunk, a row twice, rows of different lengths."""
    from hyrax.actors.model.ssd import ssd_chunked, ssd_states_at
    g = torch.Generator().manual_seed(3)
    B, T, H, P, G, N, L = 2, 13, 4, 3, 2, 5, 4
    x = torch.randn(B, T, H, P, generator=g, dtype=torch.float64)
    dt = torch.rand(B, T, H, generator=g, dtype=torch.float64)
    dt[1, 9:] = 0  # row 1 is 9 tokens long: padding
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    Bm = torch.randn(B, T, G, N, generator=g, dtype=torch.float64)
    Cm = torch.randn(B, T, G, N, generator=g, dtype=torch.float64)
    init = torch.randn(B, H, P, N, generator=g, dtype=torch.float64)
    D = torch.zeros(H, dtype=torch.float64)
    points = [(0, 4), (0, 6), (0, 12), (1, 3), (1, 8), (0, 1)]
    _, _, starts = ssd_chunked(x, dt, A, Bm, Cm, D, L, init, with_starts=True)
    got = ssd_states_at(x, dt, A, Bm, starts, torch.tensor([b for b, _ in points]),
                        torch.tensor([k for _, k in points]), L)
    for i, (b, k) in enumerate(points):
        _, want = ssd_sequential(x[b:b + 1, :k], dt[b:b + 1, :k], A, Bm[b:b + 1, :k], Cm[b:b + 1, :k], D,
                                 init[b:b + 1])
        torch.testing.assert_close(got[i], want[0], rtol=1e-10, atol=1e-10)


# float64: the torch path (the scan and the convolution, which record a capture as they pass it);
# float32: the C Mamba2 step, run pass by pass over the slices cut at their capture points, the
# state rows copied out between passes (Mamba2Mixer._packed_step). Tolerance: a reference run
# projects another number of rows (the BLAS picks its kernel by the row count)
PATHS = {"torch": (torch.float64, 1e-9), "c-step": (torch.float32, 2e-5)}


@pytest.fixture
def c_step_passes(monkeypatch) -> list[int]:
    """How many passes the C step ran with a capture in its step (each pass one call)."""
    from hyrax.actors.model import mamba2
    calls, kernel = [], mamba2.mamba2_packed_rows_

    def counted(*args, out=None, **kwargs):
        if out is not None:
            calls.append(args[5].shape[0])  # the pass's sequences
        return kernel(*args, out=out, **kwargs)

    monkeypatch.setattr(mamba2, "mamba2_packed_rows_", counted)
    return calls


def _model(layout: str, path: str):
    model = random_model(tiny_config(layout), dtype=PATHS[path][0])
    mixers = [m for m in model.modules() if hasattr(m, "native_step")]
    assert mixers and all(m.native_step for m in mixers), "no C step here: the c-step case would test nothing"
    return model


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("layout", ["mamba", "full_swa_mamba"])
def test_captured_rows_equal_the_slots_of_a_run_that_stopped_there(layout, path, c_step_passes):
    model = _model(layout, path)
    tol = PATHS[path][1]
    comps = model.components
    slot_comps = [c for c in comps if not c.paged]
    assert slot_comps and captures_mid_step(comps)
    into = {c.name: f"{c.name}.checkpoint" for c in slot_comps}
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(1, 60, (n,), generator=g).tolist() for n in (13, 7, 10)]
    caps = {0: 8, 2: 5}  # batch row -> tokens before its capture point; row 1 captures nothing
    every = shuffled_pages(model, 12, seed=10)  # disjoint pages for the three rows
    pages = [{name: t[4 * b:4 * b + 4] for name, t in every.items()} for b in range(3)]

    def pools_with_checkpoints():
        pools = fresh_pools(model)
        for c in slot_comps:
            pools[into[c.name]] = torch.zeros_like(pools[c.name])
        return pools

    pools = pools_with_checkpoints()
    seqs = [SeqSlice(p, 0, pages[b], slots_for(model, b + 1),
                     (caps[b], {c.name: 3 - b // 2 for c in slot_comps}) if b in caps else None)
            for b, p in enumerate(prompts)]
    with torch.inference_mode():
        model(build_forward_batch(seqs, comps, PAGE_SIZE, capture_into=into), pools)
        for b, k in caps.items():  # the reference: the first k tokens alone, in fresh pools
            ref = pools_with_checkpoints()
            model(build_forward_batch([SeqSlice(prompts[b][:k], 0, pages[b], slots_for(model, 1))], comps, PAGE_SIZE), ref)
            for c in slot_comps:
                got, want = pools[into[c.name]][:, 3 - b // 2], ref[c.name][:, 1]
                assert torch.allclose(got, want, rtol=tol, atol=tol), (c.name, b, (got - want).abs().max())
                assert got.abs().sum() > 0
    untouched = [r for r in range(pools[into[slot_comps[0].name]].shape[1]) if r not in (3, 2)]
    assert all(pools[into[c.name]][:, untouched].abs().sum() == 0 for c in slot_comps)
    # per Mamba2 layer: all three rows up to the points, then rows 0 and 2 on
    assert c_step_passes == ([3, 2] * len(model.cfg.layers_of("mamba2")) if path == "c-step" else [])


def _several_captures_equal_stopped_runs(model, vocab: int, seed: int, tol: float = 1e-9,
                                        want_at: dict | None = None) -> None:
    """One row captured at three points of its slice and another at one (the plan's `captures`
    path: a step passing several track boundaries of one prompt), in a batch of mixed lengths:
    every checkpoint row holds the state after exactly its own prefix."""
    comps = model.components
    slot_comps = [c for c in comps if not c.paged]
    assert slot_comps and captures_mid_step(comps)
    into = {c.name: f"{c.name}.checkpoint" for c in slot_comps}
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(1, vocab, (n,), generator=g).tolist() for n in (14, 9)]
    every = shuffled_pages(model, 8, seed=11)
    pages = [{name: t[4 * b:4 * b + 4] for name, t in every.items()} for b in range(2)]
    if want_at is None:  # row -> (tokens before, checkpoint row)
        want_at = {0: [(4, 0), (8, 1), (12, 2)], 1: [(5, 3)]}
    pools = fresh_pools(model)
    for c in slot_comps:
        pools[into[c.name]] = torch.zeros(pools[c.name].shape[0], 4, *pools[c.name].shape[2:],
                                          dtype=pools[c.name].dtype)
    seqs = [SeqSlice(p, 0, pages[b], slots_for(model, b + 1)) for b, p in enumerate(prompts)]
    captures = {b: [(k, {c.name: row for c in slot_comps}) for k, row in at] for b, at in want_at.items()}
    with torch.inference_mode():
        model(build_forward_batch(seqs, comps, PAGE_SIZE, capture_into=into, captures=captures), pools)
        for b, at in want_at.items():
            for k, row in at:
                ref = fresh_pools(model)
                model(build_forward_batch([SeqSlice(prompts[b][:k], 0, pages[b], slots_for(model, 1))], comps,
                                          PAGE_SIZE), ref)
                for c in slot_comps:
                    got, want = pools[into[c.name]][:, row], ref[c.name][:, 1]
                    assert torch.allclose(got, want, rtol=tol, atol=tol), (c.name, b, k, (got - want).abs().max())
                    assert got.abs().sum() > 0


@pytest.mark.parametrize("path", PATHS)
def test_several_captures_in_one_slice_each_equal_the_slots_of_a_run_that_stopped_there(path, c_step_passes):
    model = _model("full_swa_mamba", path)
    _several_captures_equal_stopped_runs(model, 60, 2, PATHS[path][1])
    # per Mamba2 layer: both rows to their first points, then row 0 on through its other two
    # points and its end (row 1's second run, its end, in the second pass)
    assert c_step_passes == ([2, 2, 1, 1] * len(model.cfg.layers_of("mamba2")) if path == "c-step" else [])


def test_captures_at_the_first_tokens_and_next_to_each_other(c_step_passes):
    """Runs shorter than the convolution's window (1 and 2 tokens: the conv state then mixes the
    previous run's inputs with the new ones) and a capture after the first token, on the C step."""
    model = _model("full_swa_mamba", "c-step")
    _several_captures_equal_stopped_runs(model, 60, 4, PATHS["c-step"][1], {0: [(1, 0), (2, 1), (4, 2)], 1: [(8, 3)]})
    assert c_step_passes == [2, 2, 1, 1] * len(model.cfg.layers_of("mamba2"))


def test_gated_deltanet_captures_inside_a_slice_equal_runs_that_stopped_there(tmp_path):
    """Qwen3-Next's Gated DeltaNet layers write checkpoints inside a slice too (its recurrence
    copies the state rows after each capture's token; the conv keeps the inputs before it)."""
    pytest.importorskip("transformers")
    import hf_families as hff
    from hyrax.actors.model.loader import load_model
    from test_models_checkpoints import qwen3_next

    torch.manual_seed(0)
    hf = hff.randomize_hf_(qwen3_next().eval())
    hf.save_pretrained(tmp_path)
    model = load_model(tmp_path, dtype=torch.float64)
    assert {c.name for c in model.components if not c.paged} == {"gdn_conv", "gdn_state"}
    _several_captures_equal_stopped_runs(model, hf.config.vocab_size, 3)


def test_a_capture_must_lie_inside_its_slice():
    model = random_model(tiny_config("mamba"))
    comps = model.components
    into = {c.name: f"{c.name}.checkpoint" for c in comps if not c.paged}
    bad = SeqSlice([1, 2, 3], 0, shuffled_pages(model, 1, 0), slots_for(model, 1), (3, {n: 0 for n in into}))
    with pytest.raises(ValueError, match="invalid captures"):
        build_forward_batch([bad], comps, PAGE_SIZE, capture_into=into)
    with pytest.raises(ValueError, match="invalid captures"):
        build_forward_batch([bad._replace(capture=(1, {n: 0 for n in into}))], comps, PAGE_SIZE)


@pytest.mark.parametrize("remainder", [1, 3])
def test_a_checkpoint_inside_a_chunk_is_cached_with_its_window_pages_and_hit(remainder):
    """Engine level (not deterministic, prefix cache on): a prompt's last whole page ends inside
    its last chunk; the checkpoint there is written by the forward and goes to the prefix cache
    with the sliding-window pages before it, although the chunk ran past it (a window of 6 rows
    over 4-row pages: at the chunk's end the page holding the checkpoint's oldest window row has
    left the request's window; it is released only after the cache took it). A second request
    with the same prompt hits there and generates the same tokens."""
    from engine_helpers import make_engine
    from hyrax.actors.engine.request import SamplingParams

    model = random_model(tiny_config("full_swa_mamba", sliding_window=6), dtype=torch.float64)
    e = make_engine(model, deterministic=False, prefill_chunk=8, max_batch_tokens=32)
    prompt = [(7 * i) % 50 + 3 for i in range(20 + remainder)]  # last whole page ends at 20
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = []
    for k in range(2):
        rid = e.add_request(prompt, params)
        steps = 0
        while e.has_unfinished():
            e.step()
            steps += 1
        outs.append(list(e.finished_requests.pop(rid).output_ids))
        if k == 0:
            assert e.stats.prefix.checkpoints == 1  # at 20, inside the chunk 16..20+remainder
            assert e.caching.tree.match(prompt[:-1], None, touch=False).length == 20
    assert e.stats.prefix.hits == 1 and e.stats.prefix.hit_tokens == 20
    assert outs[1] == outs[0]
    e.check_invariants()
