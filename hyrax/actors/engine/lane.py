"""The decode lane: running requests that decoded one token inside a page they hold last step
and do again this step, planned without a view.

Most entries of a busy replica's step are such decodes, and today's view costs most of a
step's per-request planning: a request's fields are read cold (the forward ran since), copied
into a `RequestView`, and read again to make an entry the same as last step's but one
position on. The lane keeps last step's entries of those requests (`LaneRows`, made by the
scheduler) with the index snapshot each was made from, and next step

- checks that nothing else happened to each: still running, the same snapshot of its indices
  (every index write drops the snapshot, indices.py; every state change goes through the
  request table), and last step's plan is the one in flight or the last committed (a step
  that failed or was never submitted leaves no lane);
- advances each one position and one draw, and leaves out those whose next token opens a
  page or whose last token is in flight (`advance`): they take the general path, as does
  every request not in the lane.

A lane entry is exactly the entry the general path (`Scheduler._steady_decode`) makes for the
request; test_decode_lane.py checks this step by step against lane-less planning.
"""
from __future__ import annotations

from operator import attrgetter, is_
from typing import Mapping, NamedTuple

from hyrax.actors.engine.indices import IndexSnapshot
from hyrax.actors.engine.plan import PlanEntry, SamplingSpec, StepPlan
from hyrax.actors.engine.request import Request, State
from hyrax.actors.engine.view import PLACEHOLDER

_IN_FLIGHT = (PLACEHOLDER,)
_state = attrgetter("state")
_snap = attrgetter("indices._snap")


class LaneRows(NamedTuple):
    """Steady decode entries, in plan order, with what the next step needs to advance them."""

    entries: tuple[PlanEntry, ...]
    snaps: tuple[IndexSnapshot, ...]  # the snapshot of the request's indices each entry was made from
    arrivals: tuple[float, ...]
    max_tokens: tuple[int, ...]


NO_ROWS = LaneRows((), (), (), ())


def steady_lane_entry(e: PlanEntry) -> bool:
    """Whether an entry the general path made as a steady decode may join the lane: its sampling
    reads no token history (no penalties, bias, min_tokens or grammar), so advancing it needs
    nothing but its position and draw."""
    s = e.sample
    return s is not None and s.process is None and s.grammar is None


def advance(rows: LaneRows, page_size: int, in_flight: bool, tokens: list[int] | None) -> tuple[LaneRows, list[int]]:
    """The rows one step on: position and draw + 1; left out, those whose next token opens a
    page (it takes one: the general path) or whose draw reaches max_tokens (it finishes with
    the step before). `tokens`: each row's last token when that step is committed (else its
    token is the one in flight, `PLACEHOLDER`). Also returns the indices of the rows kept."""
    entries, keep = [], []
    new = tuple.__new__  # the NamedTuples' own __new__ is a Python function: 3x dearer per entry
    for k, (e, limit) in enumerate(zip(rows.entries, rows.max_tokens)):
        start, s = e.start + 1, e.sample
        draw = s.draw + 1
        if not start % page_size or draw >= limit:
            continue
        spec = new(SamplingSpec, (s.temperature, s.top_p, s.top_k, s.seed, draw, s.logprobs, None, None))
        entries.append(new(PlanEntry, (e.req_id, _IN_FLIGHT if in_flight else (tokens[k],), start, e.page_tables,
                                       e.slots, spec)))
        keep.append(k)
    if len(keep) == len(rows.entries):
        return rows._replace(entries=tuple(entries)), keep
    return LaneRows(tuple(entries), *(tuple(col[k] for k in keep) for col in rows[1:])), keep


class DecodeLane:
    """The engine's lane: last plan's steady rows and their requests (`keep`), taken back,
    checked and advanced when the next step is planned (`take`)."""

    def __init__(self, page_size: int, enabled: bool):
        self.page_size = page_size
        self.enabled = enabled
        self._step: int | None = None
        self._rows = NO_ROWS
        self._reqs: list[Request] = []

    def clear(self) -> None:
        self._step, self._rows, self._reqs = None, NO_ROWS, []

    def keep(self, plan: StepPlan, rows: LaneRows, requests: Mapping[str, Request]) -> None:
        """The lane of `plan` (not yet submitted): its rows and their requests."""
        if not self.enabled or not rows.entries:
            self.clear()
            return
        self._step, self._rows = plan.step, rows
        self._reqs = list(map(requests.__getitem__, map(attrgetter("req_id"), rows.entries)))

    def take(self, in_flight: StepPlan | None, committed_step: int | None) -> tuple[LaneRows, set[int]]:
        """The rows for the next step and the `id()`s of their requests (the view leaves those
        out); nothing when the lane's plan is neither the step in flight nor the last committed
        one. Reads two fields of each request, with no per-request Python step when nothing
        changed."""
        step, rows, reqs = self._step, self._rows, self._reqs
        self.clear()
        if step is None:
            return NO_ROWS, set()
        if in_flight is not None:
            if in_flight.step != step:
                return NO_ROWS, set()
        elif committed_step != step:
            return NO_ROWS, set()
        try:
            same = all(map(is_, map(_state, reqs), [State.RUNNING] * len(reqs))) and all(
                map(is_, map(_snap, reqs), rows.snaps))
        except AttributeError:  # indices that are not an IndexTable (made by hand): checked one by one
            same = False
        committed = in_flight is None  # that step's tokens are the requests' last outputs
        if not same or committed:
            keep = [k for k, r in enumerate(reqs) if r.state is State.RUNNING
                    and getattr(r.indices, "_snap", None) is rows.snaps[k]
                    and (not committed or len(r.output_ids) == rows.entries[k].sample.draw + 1)]
            rows = LaneRows(*(tuple(col[k] for k in keep) for col in rows))
            reqs = [reqs[k] for k in keep]
        tokens = [r.output_ids[-1] for r in reqs] if committed else None
        got, kept = advance(rows, self.page_size, in_flight is not None, tokens)
        return got, set(map(id, reqs if len(kept) == len(reqs) else [reqs[k] for k in kept]))
