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
  that failed or was never submitted leaves no lane); a row whose indices changed while it
  still decodes in them (a window page released) takes its new tables and carries on;
- advances every row one position and one draw in a few array operations, and leaves out the
  rows whose next token reaches a checkpoint boundary of the prefix cache or whose draw
  reaches max_tokens: they take the general path, as does every request not in the lane. A
  row whose next token opens a page stays (`LaneRows.openers`): the scheduler takes the page
  for it. A request the general path plans as such a decode (or as one opening a page) joins
  the lane for next step.

Each lane row is exactly the entry the general path (`Scheduler._steady_decode`) makes for the
request; test_decode_lane.py re-plans every step from a full view and compares.
"""
from __future__ import annotations

import dataclasses
from itertools import chain, repeat
from operator import attrgetter, is_
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from hyrax.actors.engine.indices import IndexSnapshot, IndexTable
from hyrax.actors.engine.plan import LEFT, MAX_TOKENS, PLACEHOLDER, DecodeBlock, PlanEntry, StepPlan
from hyrax.actors.engine.request import Request, State

_state = attrgetter("state")
_snap = attrgetter("indices._snap")
_REQ_ID, _SAMPLE, _outputs = (attrgetter(f) for f in ("req_id", "sample", "output_ids"))


class LaneRows(NamedTuple):
    """The lane's rows for one step (advanced), with the index snapshot each row's tables came
    from (what checking them next step compares). `openers`: the rows whose token opens a page
    (the scheduler takes one per paged component for each, in arrival order with the other
    decodes: `arrivals`, theirs), whose tables lack that page until it does."""

    block: DecodeBlock
    snaps: tuple[IndexSnapshot, ...]
    openers: tuple[int, ...] = ()
    arrivals: tuple[float, ...] = ()


class Joiner(NamedTuple):
    """A steady decode the general path planned, with what the lane needs to carry it on."""

    entry: PlanEntry
    snap: IndexSnapshot | None  # None: the request's indices once the plan's units are claimed (it took a page)
    max_tokens: int
    stops: bool  # the request has stop token ids or stop strings


def _snapshot_of(req: Request) -> IndexSnapshot:
    """The snapshot of `req`'s indices as they are now; indices that are not an IndexTable (made
    by hand) give a copy no later snapshot is, so that next step the row leaves the lane."""
    idx = req.indices
    return idx.snapshot() if type(idx) is IndexTable else IndexSnapshot(idx)


def steady_lane_entry(e: PlanEntry) -> bool:
    """Whether an entry the general path made as a steady decode may join the lane: its sampling
    reads no token history (no penalties, bias, min_tokens or grammar), so advancing it needs
    nothing but its position and draw."""
    s = e.sample
    return s is not None and s.process is None and s.grammar is None


# max_tokens as the block's int64 column keeps it: a larger one (no request gets that far: the
# context ends it first) is the same as this
NO_LIMIT = 2**62


def steps_left(start: int, draw: int, max_tokens: int, page_size: int, checkpoint_every: int | None) -> int:
    """How many more steps a row at this position and draw may be advanced in the lane: the row
    advanced j steps runs position start + j, which must not open a page ((start + j) %
    page_size != 0), must not end on a checkpoint boundary ((start + j + 1) % checkpoint_every
    != 0), and draws draw + j < max_tokens."""
    left = min(page_size - 1 - start % page_size, max_tokens - 1 - draw)
    if checkpoint_every:
        to_boundary = (-(start + 1)) % checkpoint_every  # steps until start + j + 1 is a boundary (0: now)
        left = min(left, (to_boundary or checkpoint_every) - 1)
    return left


def block_of(entries: Sequence[PlanEntry], max_tokens: Sequence[int], stops: Sequence[bool],
             page_size: int = 1, checkpoint_every: int | None = None) -> DecodeBlock:
    """The columns of steady decode entries (joiners: a few a step), one array each, made from
    Python rows (a handful of array calls, whatever the number of rows)."""
    first = entries[0]
    slot_names, paged = tuple(first.slots), tuple(first.page_tables)
    specs = list(map(_SAMPLE, entries))
    tables = {}
    for name in paged:
        rows = [e.page_tables[name] for e in entries]
        tables[name] = _padded(rows, max(1, max(map(len, rows))))
    ints = np.array([(e.start, s.draw, s.top_k, limit, stop, steps_left(e.start, s.draw, limit, page_size,
                                                                         checkpoint_every),
                      *(e.slots[n] for n in slot_names), *(len(e.page_tables[n]) for n in paged))
                     for e, s, limit, stop in zip(entries, specs, map(min, max_tokens, repeat(NO_LIMIT)), stops)],
                    dtype=np.int64)
    return DecodeBlock(tuple(map(_REQ_ID, entries)), ints,
                       np.array([(s.temperature, s.top_p) for s in specs], dtype=np.float64).reshape(len(specs), 2),
                       tables, slot_names, tuple(s.seed for s in specs), tuple(s.logprobs for s in specs))


def _padded(rows: Sequence[Sequence[int]], width: int) -> np.ndarray:
    """(len(rows), width) int64 page tables, -1 after each row's own pages."""
    if all(len(t) == width for t in rows):  # the usual case: one flat read of every value (~3x faster)
        return np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=width * len(rows)).reshape(-1, width)
    return np.array([(*t, *(-1,) * (width - len(t))) for t in rows], dtype=np.int64).reshape(-1, width)


def widened(t: np.ndarray, width: int) -> np.ndarray:
    """Page tables `t` (B, P) as (B, width), -1 in the new columns: `t` itself when as wide, else
    a new array (not np.pad: ~30 us of argument handling for a few hundred values)."""
    if t.shape[1] == width:
        return t
    out = np.full((t.shape[0], width), -1, dtype=t.dtype)
    out[:, :t.shape[1]] = t
    return out


def widened_copy(t: np.ndarray, width: int) -> np.ndarray:
    """`widened`, always a new array (to write rows into)."""
    return widened(t, width) if width > t.shape[1] else t.copy()


def concat(a: DecodeBlock, b: DecodeBlock) -> DecodeBlock:
    """`a`'s rows, then `b`'s (tables padded to the wider)."""
    tables = {}
    for name, ta in a.tables.items():
        w = max(ta.shape[1], b.tables[name].shape[1])
        tables[name] = np.concatenate([widened(ta, w), widened(b.tables[name], w)])
    return DecodeBlock(a.req_ids + b.req_ids, np.concatenate([a.ints, b.ints]), np.concatenate([a.floats, b.floats]),
                       tables, a.slot_names, a.seeds + b.seeds, a.logprobs + b.logprobs)


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
        if rows is not None and rows.openers:  # their new pages are claimed: carried on with those indices
            snaps = list(rows.snaps)
            for k in rows.openers:
                snaps[k] = _snapshot_of(reqs[k])
            rows = LaneRows(rows.block, tuple(snaps))
        if joiners:
            joined = list(map(requests.__getitem__, (j.entry.req_id for j in joiners)))
            more = LaneRows(block_of([j.entry for j in joiners], [j.max_tokens for j in joiners],
                                     [j.stops for j in joiners], self.page_size, self.checkpoint_every),
                            tuple(j.snap if j.snap is not None else _snapshot_of(r)
                                  for j, r in zip(joiners, joined)))
            reqs = reqs + joined
            rows = more if rows is None else LaneRows(concat(rows.block, more.block), rows.snaps + more.snaps)
        self._step, self._rows, self._reqs = plan.step, rows, reqs

    def take(self, in_flight: StepPlan | None, committed_step: int | None) -> tuple[LaneRows | None, Sequence[Request]]:
        """The rows for the next step, advanced, and their requests in row order (the view
        leaves those out); None when the lane's plan is neither the step in flight nor the last
        committed one. Reads two fields of each request; no per-request Python step when
        nothing changed. Left out: rows whose request changed, and rows with no step left
        (`steps_left`) other than those whose token opens a page (`LaneRows.openers`): they take
        the general path."""
        step, rows, reqs = self._step, self._rows, self._reqs
        self.clear()
        self._taken = []
        if step is None or rows is None:
            return None, ()
        if (in_flight.step if in_flight is not None else committed_step) != step:
            return None, ()
        try:
            same = all(map(is_, map(_state, reqs), [State.RUNNING] * len(reqs))) and all(
                map(is_, map(_snap, reqs), rows.snaps))
        except AttributeError:  # indices that are not an IndexTable (made by hand): checked one by one
            same = False
        committed = in_flight is None  # that step's tokens are the requests' last outputs
        changed, snaps, base = [], rows.snaps, rows.block
        if not same or committed:
            changed, fresh = self._changed(rows, reqs, committed)
            if fresh:  # new snapshots of indices the rows still decode in: the rows carry on with them
                base = refreshed(base, fresh, snaps)
                snaps = tuple(fresh[k] if k in fresh else s for k, s in enumerate(snaps))
        tokens = np.array([o[-1] if o else PLACEHOLDER for o in map(_outputs, reqs)],
                          dtype=np.int64) if committed else None
        block = base.advanced(tokens)
        ok = block.ints[:, LEFT] >= 0
        opening: list[int] = []
        if not ok.all():
            block, opening = self._opening(block, ok)
            if opening:
                ok[opening] = True
        if changed:
            ok[changed] = False
        if not ok.all():
            keep = np.flatnonzero(ok)
            ks = keep.tolist()
            block, snaps, reqs = block.rows(keep), tuple(snaps[k] for k in ks), [reqs[k] for k in ks]
            if opening:
                at = {k: i for i, k in enumerate(ks)}
                opening = [at[k] for k in opening if k in at]
        if not reqs:
            return None, ()
        self._taken = reqs
        return LaneRows(block, snaps, tuple(opening), tuple(reqs[k].arrival for k in opening)), reqs

    def _opening(self, block: DecodeBlock, ok: np.ndarray) -> tuple[DecodeBlock, list[int]]:
        """(`block` with the rows that open a page given their steps left from there, those
        rows): rows out of steps whose position starts a page, whose draw is below max_tokens
        and that do not end on a checkpoint boundary. A few rows a step: looked at one by one
        (array operations on the whole block cost more, ~10 us each with the caches cold)."""
        ps, every = self.page_size, self.checkpoint_every
        out = np.flatnonzero(~ok).tolist()
        rows, lefts = [], []
        for k, (start, draw, _, limit) in zip(out, block.ints[out, :MAX_TOKENS + 1].tolist()):
            if start % ps == 0 and draw < limit and not (every and (start + 1) % every == 0):
                rows.append(k)
                lefts.append(steps_left(start, draw, limit, ps, every))
        if not rows:
            return block, rows
        ints = block.ints.copy()
        ints[rows, LEFT] = lefts
        return dataclasses.replace(block, ints=ints), rows

    @staticmethod
    def _changed(rows: LaneRows, reqs: list[Request], committed: bool) -> tuple[list[int], dict[int, IndexSnapshot]]:
        """(rows to leave out, {row: a new snapshot to carry it on with}). A running request
        whose indices changed since its row was made - a window page released when the step
        before was committed, or state moved out and restored exactly (a committed step only:
        its computed tokens and outputs must be the row's) - carries on with its indices as
        they are now, which is what a view would plan it with."""
        b = rows.block
        starts, draws = (b.starts.tolist(), b.draws.tolist()) if committed else ((), ())
        names = frozenset((*b.tables, *b.slot_names))
        running, snaps = State.RUNNING, rows.snaps
        suspects = range(len(reqs))
        if not committed:  # only a row whose state or indices changed can be left out or refreshed
            try:
                suspects = [k for k, (st, snap, old) in enumerate(zip(map(_state, reqs), map(_snap, reqs), snaps))
                            if st is not running or snap is not old]
            except AttributeError:  # indices that are not an IndexTable (made by hand): every row
                pass
        out, fresh = [], {}
        for k in suspects:
            r, old = reqs[k], snaps[k]
            if r.state is not running:
                out.append(k)
                continue
            if committed and (len(r.output_ids) != draws[k] + 1 or r.num_computed != starts[k] + 1):
                out.append(k)
                continue
            idx = r.indices
            if getattr(idx, "_snap", None) is old:
                continue
            snap = idx.snapshot() if type(idx) is IndexTable else None
            if snap is None or not names <= snap.keys():
                out.append(k)
            else:
                fresh[k] = snap
        return out, fresh


def refreshed(block: DecodeBlock, fresh: dict[int, IndexSnapshot], old: Sequence[IndexSnapshot]) -> DecodeBlock:
    """`block` with rows `fresh` (row -> snapshot) taking their page tables and slots from the
    snapshot (new arrays: a block is never written once made), where they differ from `old`
    (each row's snapshot before; an index write replaces only the value it changes, so a
    component whose value is the same object is left as it is - a window page released
    changes that window's table alone); a few array operations per changed component."""
    ks = list(fresh)
    ints = None
    at_slots = LEFT + 1
    at_pages = at_slots + len(block.slot_names)
    tables = dict(block.tables)
    for j, name in enumerate(block.tables):
        rows = [fresh[k][name] for k in ks]
        was = [old[k][name] for k in ks]
        if all(map(is_, rows, was)):
            continue
        lens = list(map(len, rows))
        t = tables[name]
        width = max(t.shape[1], *lens)
        t = tables[name] = widened_copy(t, width)
        t[ks] = _padded(rows, width)
        if lens != list(map(len, was)):
            ints = block.ints.copy() if ints is None else ints
            ints[ks, at_pages + j] = lens
    for j, name in enumerate(block.slot_names):
        slots = [fresh[k][name] for k in ks]
        if not all(map(is_, slots, [old[k][name] for k in ks])):
            ints = block.ints.copy() if ints is None else ints
            ints[ks, at_slots + j] = [u[0] for u in slots]
    return DecodeBlock(block.req_ids, block.ints if ints is None else ints, block.floats, tables, block.slot_names,
                       block.seeds, block.logprobs, block.tokens)
