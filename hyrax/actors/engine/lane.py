"""The decode lane: running requests that decoded one token inside a page they hold last step
and do again this step, kept as columns across steps and planned without a per-request object.

Most rows of a busy replica's step are such decodes, and making a view and a plan entry per
request per step cost most of a step's per-request planning: a request's fields are read cold
(the forward ran since), copied into a `RequestView`, and read again to make an entry the
same as last step's but one position on. The lane keeps last step's rows of those requests as
a `DecodeBlock` (plan.py) with the index snapshot each row's tables came from, and next step

- checks that nothing else happened to each: still running, the same snapshot of its indices
  (every index write drops the snapshot, indices.py; every state change goes through the
  request table), and last step's plan is the one in flight or the last committed (a step
  that failed or was never submitted leaves no lane);
- advances every row one position and one draw in a few array operations, and leaves out the
  rows whose next token opens a page, reaches a checkpoint boundary of the prefix cache, or
  whose draw reaches max_tokens: they take the general path, as does every request not in
  the lane. A request the general path plans as such a decode joins the lane for next step.

Each lane row is exactly the entry the general path (`Scheduler._steady_decode`) makes for the
request; test_decode_lane.py re-plans every step from a full view and compares.
"""
from __future__ import annotations

from itertools import chain
from operator import attrgetter, is_, itemgetter
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from hyrax.actors.engine.indices import IndexSnapshot
from hyrax.actors.engine.plan import DecodeBlock, PlanEntry, StepPlan
from hyrax.actors.engine.request import Request, State

_state = attrgetter("state")
_snap = attrgetter("indices._snap")
_REQ_ID, _START, _TABLES, _SLOTS, _SAMPLE = (attrgetter(f) for f in ("req_id", "start", "page_tables", "slots", "sample"))


class LaneRows(NamedTuple):
    """The lane's rows for one step (advanced), with what checking and advancing them next needs."""

    block: DecodeBlock
    snaps: tuple[IndexSnapshot, ...]  # the snapshot of each row's request's indices its tables came from
    # int64 (B,): how many more steps each row may be advanced before its next token opens a page,
    # ends on a checkpoint boundary or its draw reaches max_tokens (`steps_left`)
    left: np.ndarray


class Joiner(NamedTuple):
    """A steady decode the general path planned, with what the lane needs to carry it on."""

    entry: PlanEntry
    snap: IndexSnapshot
    max_tokens: int
    stops: bool  # the request has stop token ids or stop strings


def steady_lane_entry(e: PlanEntry) -> bool:
    """Whether an entry the general path made as a steady decode may join the lane: its sampling
    reads no token history (no penalties, bias, min_tokens or grammar), so advancing it needs
    nothing but its position and draw."""
    s = e.sample
    return s is not None and s.process is None and s.grammar is None


def _i64(values) -> np.ndarray:
    return np.fromiter(values, dtype=np.int64)


def _tables(rows: Sequence[Sequence[int]]) -> tuple[np.ndarray, np.ndarray]:
    """((n, P) int64 page tables, -1 after each row's own, P the longest; (n,) their lengths)."""
    lens = _i64(map(len, rows))
    out = np.full((len(rows), max(int(lens.max()), 1)), -1, dtype=np.int64)
    out[np.arange(out.shape[1])[None, :] < lens[:, None]] = _i64(chain.from_iterable(rows))
    return out, lens


def steps_left(starts: np.ndarray, draws: np.ndarray, max_tokens: np.ndarray, page_size: int,
               checkpoint_every: int | None) -> np.ndarray:
    """How many more steps rows at these positions and draws may be advanced in the lane: the
    row advanced j steps runs position start + j, which must not open a page ((start + j) %
    page_size != 0), must not end on a checkpoint boundary ((start + j + 1) % checkpoint_every
    != 0), and draws draw + j < max_tokens."""
    left = np.minimum(page_size - 1 - starts % page_size, max_tokens - 1 - draws)
    if checkpoint_every:
        to_boundary = (-(starts + 1)) % checkpoint_every  # steps until start + j + 1 is a boundary (0: now)
        left = np.minimum(left, np.where(to_boundary == 0, checkpoint_every, to_boundary) - 1)
    return left


def block_of(entries: Sequence[PlanEntry], max_tokens: np.ndarray, stops: np.ndarray) -> DecodeBlock:
    """The columns of steady decode entries (joiners: a few a step)."""
    specs = list(map(_SAMPLE, entries))
    first = entries[0]
    tables, n_pages = {}, {}
    table_maps, slot_maps = list(map(_TABLES, entries)), list(map(_SLOTS, entries))
    for name in first.page_tables:
        tables[name], n_pages[name] = _tables(list(map(itemgetter(name), table_maps)))
    temperature, top_p, top_k, seeds, draws, logprobs = (list(col) for col in zip(*(s[:6] for s in specs)))
    return DecodeBlock(
        req_ids=tuple(map(_REQ_ID, entries)), starts=_i64(map(_START, entries)), tokens=None,
        tables=tables, n_pages=n_pages, slots={name: _i64(map(itemgetter(name), slot_maps)) for name in first.slots},
        draws=np.array(draws, dtype=np.int64), temperature=np.array(temperature, dtype=np.float64),
        top_p=np.array(top_p, dtype=np.float64), top_k=np.array(top_k, dtype=np.int64), seeds=tuple(seeds),
        logprobs=tuple(logprobs), max_tokens=max_tokens, stops=stops)


def _widened(t: np.ndarray, width: int) -> np.ndarray:
    return t if t.shape[1] == width else np.pad(t, ((0, 0), (0, width - t.shape[1])), constant_values=-1)


def concat(a: DecodeBlock, b: DecodeBlock) -> DecodeBlock:
    """`a`'s rows, then `b`'s (tables padded to the wider)."""
    tables = {}
    for name, ta in a.tables.items():
        w = max(ta.shape[1], b.tables[name].shape[1])
        tables[name] = np.concatenate([_widened(ta, w), _widened(b.tables[name], w)])
    cat = np.concatenate
    return DecodeBlock(
        a.req_ids + b.req_ids, cat([a.starts, b.starts]), None, tables,
        {n: cat([v, b.n_pages[n]]) for n, v in a.n_pages.items()}, {n: cat([v, b.slots[n]]) for n, v in a.slots.items()},
        cat([a.draws, b.draws]), cat([a.temperature, b.temperature]), cat([a.top_p, b.top_p]),
        cat([a.top_k, b.top_k]), a.seeds + b.seeds, a.logprobs + b.logprobs, cat([a.max_tokens, b.max_tokens]),
        cat([a.stops, b.stops]))


def advance(rows: LaneRows, tokens: np.ndarray | None) -> tuple[LaneRows, np.ndarray | None]:
    """The rows one step on: position and draw + 1 (`tokens`: each row's token when the step
    before is committed, else None: the one in flight). Left out: the rows with no step left
    (`steps_left`): they take the general path. Also returns the indices of the rows kept
    (None: all of them)."""
    b, left = rows.block, rows.left
    block = b.__class__(b.req_ids, b.starts + 1, tokens, b.tables, b.n_pages, b.slots, b.draws + 1, b.temperature,
                        b.top_p, b.top_k, b.seeds, b.logprobs, b.max_tokens, b.stops)
    ok = left > 0
    if ok.all():
        return LaneRows(block, rows.snaps, left - 1), None
    keep = np.flatnonzero(ok)
    return LaneRows(block.rows(keep), tuple(rows.snaps[k] for k in keep.tolist()), left[keep] - 1), keep


class DecodeLane:
    """The engine's lane: last plan's steady rows and their requests (`keep`), taken back,
    checked and advanced when the next step is planned (`take`)."""

    def __init__(self, page_size: int, checkpoint_every: int | None, enabled: bool):
        self.page_size = page_size
        self.checkpoint_every = checkpoint_every  # the prefix cache's checkpoint interval (None: off)
        self.enabled = enabled
        self._taken: list[Request] = []  # the requests of the rows `take` gave out, in row order
        self.clear()

    def clear(self) -> None:
        self._step: int | None = None
        self._rows: LaneRows | None = None
        self._reqs: list[Request] = []

    def keep(self, plan: StepPlan, rows: LaneRows | None, joiners: Sequence[Joiner],
             requests: Mapping[str, Request]) -> None:
        """The lane after `plan` (not yet submitted): its block's rows, then the joiners."""
        self.clear()
        if not self.enabled or (rows is None and not joiners):
            return
        reqs = [] if rows is None else self._taken
        if joiners:
            block = block_of([j.entry for j in joiners], _i64(j.max_tokens for j in joiners),
                             np.array([j.stops for j in joiners], dtype=bool))
            more = LaneRows(block, tuple(j.snap for j in joiners),
                            steps_left(block.starts, block.draws, block.max_tokens, self.page_size, self.checkpoint_every))
            reqs = reqs + list(map(requests.__getitem__, more.block.req_ids))
            rows = more if rows is None else LaneRows(concat(rows.block, more.block), rows.snaps + more.snaps,
                                                      np.concatenate([rows.left, more.left]))
        self._step, self._rows, self._reqs = plan.step, rows, reqs

    def take(self, in_flight: StepPlan | None, committed_step: int | None) -> tuple[LaneRows | None, set[int]]:
        """The rows for the next step and the `id()`s of their requests (the view leaves those
        out); None when the lane's plan is neither the step in flight nor the last committed
        one. Reads two fields of each request; no per-request Python step when nothing changed."""
        step, rows, reqs = self._step, self._rows, self._reqs
        self.clear()
        self._taken = []
        if step is None or rows is None:
            return None, set()
        if (in_flight.step if in_flight is not None else committed_step) != step:
            return None, set()
        try:
            same = all(map(is_, map(_state, reqs), [State.RUNNING] * len(reqs))) and all(
                map(is_, map(_snap, reqs), rows.snaps))
        except AttributeError:  # indices that are not an IndexTable (made by hand): checked one by one
            same = False
        committed = in_flight is None  # that step's tokens are the requests' last outputs
        if not same or committed:
            draws = rows.block.draws.tolist()
            keep = [k for k, r in enumerate(reqs) if r.state is State.RUNNING
                    and getattr(r.indices, "_snap", None) is rows.snaps[k]
                    and (not committed or len(r.output_ids) == draws[k] + 1)]
            if len(keep) < len(reqs):
                idx = np.array(keep, dtype=np.int64)
                rows = LaneRows(rows.block.rows(idx), tuple(rows.snaps[k] for k in keep), rows.left[idx])
                reqs = [reqs[k] for k in keep]
        if not reqs:
            return None, set()
        tokens = _i64(r.output_ids[-1] for r in reqs) if committed else None
        got, kept = advance(rows, tokens)
        if kept is not None:
            reqs = [reqs[k] for k in kept.tolist()]
        if not reqs:
            return None, set()
        self._taken = reqs
        return got, set(map(id, reqs))
