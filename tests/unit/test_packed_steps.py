"""Packed steps (HybridModel.forward): a step's prompt slices run on their real tokens only, back
to back, and its decode tokens join them in the same forward (MixedBatch), attention and any
mixer that needs (B, T) rows running each part as its own batch.

Reference: the same steps as separate forwards of padded rows - decode tokens in one, prompt
slices in another, each padded to its longest - what the engine ran before packing. Every
step's logits agree, and every pool after it (K/V, recurrent state, checkpoints), every
layout, with the Mamba2 C step and with the torch path (whose mixer runs each part's rows),
through the whole engine: chunked prefill, decode tokens beside chunks, one-token slices among
longer ones, checkpoints captured inside chunks, forced retraction."""
from __future__ import annotations

import copy
from collections import Counter

import pytest
import torch
from engine_helpers import HYBRID, LAYOUTS, assert_idle_clean, make_engine, make_prompts, tiny_model

from hyrax.actors.engine.rank_runtime import RankRuntime
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.step_groups import length_groups
from hyrax.actors.model.batch import ForwardBatch, MixedBatch
from hyrax.actors.model.mamba2 import Mamba2Mixer


def _separate_padded(self, block, entries, captures, fills):
    """The reference forward of a step: one padded batch per length group, rows in step order."""
    nb = len(block) if block is not None else 0
    out = [None] * (nb + len(entries))
    for group in length_groups([1] * nb + [len(e.token_ids) for e in entries]):
        for i, row in zip(group, self._forward(block, entries, captures, fills, group)):
            out[i] = row
    return torch.stack(out)


# the first step: prompt slices of different lengths only (no slice of one token: the first
# steps after it carry each request's next token as a one-token slice)
FIRST = [[(5 * i + j) % 60 + 1 for j in range(n)] for i, n in enumerate((3, 5, 6))]
# arriving once those decode: more prompts, among them one-token slices beside longer ones - a
# one-token prompt, and prompts that leave a last chunk of one token (prefill_chunk 8); with these,
# a step also ends on a one-token slice its budget cut after longer ones (the forward's rows come
# back reordered then)
LATER = make_prompts(9, seed=0, lo=3, hi=30) + [[5], [7] * 9, [11] * 17, [4] * 15]


def _run_all(engine) -> list[list[int]]:
    """FIRST, then LATER once the first requests decode; run to the end, check the pools."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in FIRST]
    while not any(r.output_ids for r in engine.requests.values()):
        engine.step()
    ids += [engine.add_request(p, params) for p in LATER]
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()
        engine.check_invariants()
    assert_idle_clean(engine)
    return [engine.finished_requests[i].output_ids for i in ids]


def _run(layout: str, packing: bool, native: bool, monkeypatch,
         **config) -> tuple[list, list[torch.Tensor], Counter, list[dict]]:
    """Greedy outputs, every step's logits (rows in step order), what the forwards ran, and every
    pool (K/V, recurrent state, prefix-cache checkpoints) after every step."""
    with monkeypatch.context() as m:
        if not packing:
            m.setattr(ForwardBatch, "packs", property(lambda b: False))
            m.setattr(RankRuntime, "_forward_grouped", _separate_padded)
        model = copy.deepcopy(tiny_model(layout))
        for mod in model.modules():
            if isinstance(mod, Mamba2Mixer):
                assert mod.native_step, "no C step here: the test would compare the torch path with itself"
                mod.native_step = native
        seen = Counter()
        forward = model.forward

        def counted(batch, pools, *args, **kwargs):
            seen["mixed" if isinstance(batch, MixedBatch) else "packed" if batch.packs else "rows"] += 1
            if isinstance(batch, MixedBatch) and batch.capture is not None:
                seen["mixed with a capture inside a chunk"] += 1
            return forward(batch, pools, *args, **kwargs)

        model.forward = counted
        engine = make_engine(model, **{"deterministic": False, "forced_retraction_interval": 5, **config})
        rank = engine.executor.rank
        grouped, logits, pools = rank._forward_grouped, [], []

        def recorded(block, entries, captures, fills):
            nb = len(block) if block is not None else 0
            groups = length_groups([1] * nb + [len(e.token_ids) for e in entries])
            if len(groups) == 2 and nb and groups[0][-1] >= nb:
                seen["one-token entries beside decode rows"] += 1
            if len(groups) == 2 and groups[0][-1] != len(groups[0]) - 1:
                seen["one-token slices after longer ones"] += 1  # the forward's rows are reordered
            out = grouped(block, entries, captures, fills)
            logits.append(out.clone())
            pools.append({name: p.clone() for name, p in rank.pools.items()})
            return out

        rank._forward_grouped = recorded
        outs = _run_all(engine)
        return outs, logits, seen, pools


CASES = [(layout, native) for layout in LAYOUTS for native in ((True, False) if "mamba" in layout else (True,))]


def _assert_same_steps(a: tuple, b: tuple) -> None:
    """Same outputs; every step's logits and every pool after it alike. Not bit for bit:
    token-wise products run on another number of rows (the BLAS picks its kernel by the row
    count), and a Mamba2 decode token goes through the C prefill step of one token instead of
    the decode step; measured here up to 4e-5, where a wrong row is O(1)."""
    (outs_a, logits_a, _, pools_a), (outs_b, logits_b, _, pools_b) = a, b
    assert len(logits_a) == len(logits_b)
    for la, lb, pa, pb in zip(logits_a, logits_b, pools_a, pools_b):
        torch.testing.assert_close(la, lb, rtol=1e-4, atol=1e-4)
        assert pa.keys() == pb.keys()
        for name in pa:
            torch.testing.assert_close(pa[name], pb[name], rtol=1e-4, atol=1e-4, msg=name)
    assert outs_a == outs_b


@pytest.mark.parametrize("layout,native", CASES, ids=[f"{la}-{'c' if n else 'torch'}" for la, n in CASES])
def test_packed_and_mixed_steps_give_the_separate_padded_steps_logits(layout, native, monkeypatch):
    padded = _run(layout, False, native, monkeypatch)
    packed = _run(layout, True, native, monkeypatch)
    seen = packed[2]
    # every kind of step ran, or the comparison would not cover it
    assert seen["mixed"] > 0 and seen["packed"] > 0, seen
    assert seen["one-token entries beside decode rows"] > 0 and seen["one-token slices after longer ones"] > 0, seen
    _assert_same_steps(packed, padded)


@pytest.mark.parametrize("native", [True, False], ids=["c", "torch"])
def test_mixed_steps_with_prefix_cache_captures_inside_chunks(native, monkeypatch):
    """Recurrent-state checkpoints every 8 tokens land inside prompt chunks cut at other
    places: the Mamba2 layers then run each part of a mixed step on its rows (the chunks'
    with their captures); the same logits and pools, checkpoint pools included, as separate
    padded forwards."""
    config = {"mamba_track_interval": 8}
    padded = _run(HYBRID, False, native, monkeypatch, **config)
    packed = _run(HYBRID, True, native, monkeypatch, **config)
    assert packed[2]["mixed with a capture inside a chunk"] > 0, packed[2]
    assert any(name.endswith(".checkpoint") for name in packed[3][0]), list(packed[3][0])
    _assert_same_steps(packed, padded)
