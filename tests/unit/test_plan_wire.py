"""A plan's decode block pickles as one run of raw bytes (`DecodeBlock.__reduce__`): what the
ranks load is the same block - every array equal, of the same dtype and shape, writable as the
block's own are - and its rows are the same plan entries, for blocks made by an engine (with
tokens and without, page tables of several widths) and an empty one."""
from __future__ import annotations

import pickle

import numpy as np
import pytest

from engine_helpers import HYBRID, greedy, make_engine, make_prompts, tiny_model
from hyrax.actors.engine.plan import DecodeBlock


def _same(a: DecodeBlock, b: DecodeBlock) -> None:
    for name in ("ints", "floats", "tokens"):
        x, y = getattr(a, name), getattr(b, name)
        if x is None:
            assert y is None
            continue
        assert x.dtype == y.dtype and x.shape == y.shape and np.array_equal(x, y) and y.flags.writeable
    assert list(a.tables) == list(b.tables)
    for name, t in a.tables.items():
        assert t.dtype == b.tables[name].dtype and np.array_equal(t, b.tables[name])
    assert (a.req_ids, a.slot_names, a.seeds, a.logprobs) == (b.req_ids, b.slot_names, b.seeds, b.logprobs)
    assert [a.entry(k) for k in range(len(a))] == [b.entry(k) for k in range(len(b))]


@pytest.mark.parametrize("overlap", [False, True])
def test_decode_blocks_cross_the_wire_unchanged(overlap):
    engine = make_engine(tiny_model(HYBRID), page_size=8, overlap=overlap)
    blocks = []
    inner = engine.executor.submit

    def submit(plan):
        if plan.decode is not None:
            blocks.append(plan.decode)
        return inner(plan)
    engine.executor.submit = submit
    for p in make_prompts(5, seed=3, lo=2, hi=20):
        engine.add_request(p, greedy(24, seed=7))
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()
    assert len(blocks) > 10
    assert any(b.tokens is not None for b in blocks) == (not overlap)  # a committed step's tokens ride along
    assert len({t.shape[1] for b in blocks for t in b.tables.values()}) > 1  # tables of several widths
    for b in blocks:
        _same(b, pickle.loads(pickle.dumps(b, protocol=pickle.HIGHEST_PROTOCOL)))
    empty = DecodeBlock((), np.zeros((0, 8), dtype=np.int64), np.zeros((0, 2)), {"kv": np.zeros((0, 1), dtype=np.int64)},
                        ("s",), (), ())
    _same(empty, pickle.loads(pickle.dumps(empty)))
