"""The pool rows a step's attention reads (`build_forward_batch`'s read_rows) against a plain
per-key reference: key k of request b is position read_start + k, on page table[pos // page]
at offset pos % page; keys past a request's context read row 0. Batches where every request
reads from position 0 take a page-by-page route, others a per-key lookup: both are checked,
and a key on a page that is not allocated is an error on either."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from engine_helpers import tiny_config
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.state import WINDOW, derive_components

PS = 4
COMPS = derive_components(tiny_config("full_swa_mamba"), dtype=torch.float32)
PAGED = [c for c in COMPS if c.paged]


def _seqs(rng: random.Random, n: int, max_ctx: int, decode: bool) -> list[SeqSlice]:
    seqs = []
    for i in range(n):
        q = 1 if decode else rng.randint(1, min(6, max_ctx))
        start = rng.randint(0, max_ctx - q)
        pages = -(-(start + q) // PS)
        tables = {}
        for c in PAGED:
            table = [rng.randrange(1000) for _ in range(pages)]
            if c.kind == WINDOW:  # pages wholly before the window are released (-1)
                first_live = max(start - c.window + 1, 0) // PS
                table[:first_live] = [-1] * first_live
            tables[c.name] = table
        seqs.append(SeqSlice([7] * q, start, tables, {c.name: i for c in COMPS if not c.paged}))
    return seqs


def _reference(seqs: list[SeqSlice], comp) -> np.ndarray:
    starts = [s.start for s in seqs]
    ctx = [s.start + len(s.token_ids) for s in seqs]
    first = [max(st - comp.window + 1, 0) if comp.kind == WINDOW else 0 for st in starts]
    K = max(c - f for c, f in zip(ctx, first))
    out = np.zeros((len(seqs), K), dtype=np.int64)
    for b, s in enumerate(seqs):
        for k in range(ctx[b] - first[b]):
            pos = first[b] + k
            out[b, k] = s.page_tables[comp.name][pos // PS] * PS + pos % PS
    return out


@pytest.mark.parametrize("max_ctx", [3, 9, 40])  # 3: every window read starts at 0 too
@pytest.mark.parametrize("decode", [True, False])
def test_read_rows_equal_the_per_key_reference(max_ctx, decode):
    rng = random.Random(max_ctx * 2 + decode)
    for _ in range(20):
        seqs = _seqs(rng, rng.randint(1, 9), max_ctx, decode)
        batch = build_forward_batch(seqs, COMPS, PS)
        for c in PAGED:
            np.testing.assert_array_equal(batch.attn[c.name].read_rows.numpy(), _reference(seqs, c), err_msg=c.name)


@pytest.mark.parametrize("kind", ["token", "window"])
def test_a_key_on_a_page_that_is_not_allocated_is_an_error(kind):
    comp = next(c for c in PAGED if (c.kind == WINDOW) == (kind == "window"))
    seqs = [SeqSlice([7], 2, {c.name: [3] for c in PAGED}, {c.name: 0 for c in COMPS if not c.paged}),
            SeqSlice([7], 6, {c.name: [5, 6] for c in PAGED}, {c.name: 1 for c in COMPS if not c.paged})]
    seqs[1].page_tables[comp.name][1] = -1  # position 6 (the query's own key) has no page
    with pytest.raises(RuntimeError, match=f"{comp.name}: a step touches a position whose page is not allocated"):
        build_forward_batch(seqs, COMPS, PS)


@pytest.mark.parametrize("max_ctx", [3, 9, 40])
@pytest.mark.parametrize("decode", [True, False])
def test_key_positions_validity_and_padding_equal_the_per_key_reference(max_ctx, decode):
    """key_pos, key_valid and pad_keys (the flat indices of the invalid keys, computed from the
    counts alone) against a key-by-key reference, with a decode block in front of the slices."""
    from hyrax.actors.engine.lane import block_of
    from hyrax.actors.engine.plan import PlanEntry, SamplingSpec

    rng = random.Random(max_ctx * 3 + decode)
    for _ in range(20):
        seqs = _seqs(rng, rng.randint(1, 9), max_ctx, decode)
        head = [s for s in _seqs(rng, rng.randint(0, 4), max_ctx, True)]
        block = block_of([PlanEntry(f"r{k}", (7,), s.start, {n: tuple(t) for n, t in s.page_tables.items()}, s.slots,
                                    SamplingSpec(0.0, 1.0, 0, 0, 0)) for k, s in enumerate(head)],
                         [100] * len(head), [False] * len(head)) if head else None
        batch = build_forward_batch(seqs, COMPS, PS, block=block)
        every = head + seqs
        for c in PAGED:
            idx = batch.attn[c.name]
            first = [max(s.start - c.window + 1, 0) if c.kind == WINDOW else 0 for s in every]
            n_keys = [s.start + len(s.token_ids) - f for s, f in zip(every, first)]
            K = max(n_keys)
            pos = np.array([[f + k for k in range(K)] for f in first])
            valid = np.array([[k < n for k in range(K)] for n in n_keys])
            np.testing.assert_array_equal(idx.key_pos.numpy(), pos, err_msg=c.name)
            np.testing.assert_array_equal(idx.key_valid.numpy(), valid, err_msg=c.name)
            np.testing.assert_array_equal(idx.pad_keys.numpy(), np.flatnonzero(~valid), err_msg=c.name)
            np.testing.assert_array_equal(idx.read_rows.numpy(), _reference(every, c), err_msg=c.name)
