"""The scheduler's input: an immutable view of a replica as the next step will find it.

The step in flight is already folded in: a request it runs is seen with the tokens that step
computes and the token it samples (as `PLACEHOLDER`, which the ranks fill in). Nothing here
is read back from live request fields while the scheduler plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Callable, Mapping, NamedTuple, Sequence

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.indices import IndexSnapshot, IndexTable
from hyrax.actors.engine.plan import PLACEHOLDER, StepPlan
from hyrax.actors.engine.request import Request, SamplingParams

if TYPE_CHECKING:
    from hyrax.actors.engine.lane import LaneRows


class Tokens(Sequence[int]):
    """A request's prompt + outputs as a view sees them, made in O(1) whatever their length:
    the prompt, the first `n_out` of its outputs, then `extra` PLACEHOLDERs (the tokens the step
    in flight samples). It reads the request's own lists, which only ever grow (`Request`), and
    never past what it was made with, so what it says does not change. Slices are tuples."""

    __slots__ = ("prompt", "outputs", "n_out", "extra", "n")

    def __init__(self, prompt: Sequence[int], outputs: Sequence[int], n_out: int, extra: int = 0):
        self.prompt, self.outputs, self.n_out, self.extra = prompt, outputs, n_out, extra
        self.n = len(prompt) + n_out + extra

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, k):
        if not isinstance(k, slice):
            i = range(self.n)[k]  # IndexError as a tuple's
            return self[i : i + 1][0]
        a, b = k.start, k.stop
        if k.step is not None or a is None or b is None or not 0 <= a < b <= self.n:  # the general case
            a, b, stride = k.indices(self.n)
            if stride != 1:
                return tuple(self)[k]
            if b <= a:
                return ()
        n_prompt = len(self.prompt)
        real = n_prompt + self.n_out
        out = tuple(self.prompt[a:b]) if a < n_prompt else ()
        if b > n_prompt and a < real:
            out += tuple(self.outputs[max(a - n_prompt, 0) : min(b, real) - n_prompt])
        if b > real:
            out += (PLACEHOLDER,) * (b - max(a, real))
        return out

    def last(self) -> tuple[int]:
        """`self[n - 1 : n]` for a decode step (its one token) without the general slice's work."""
        if self.extra:
            return (PLACEHOLDER,)
        if self.n_out:
            return (self.outputs[self.n_out - 1],)
        return (self.prompt[-1],)

    def __iter__(self):
        yield from self.prompt
        yield from self.outputs[: self.n_out]
        yield from (PLACEHOLDER,) * self.extra

    def __eq__(self, other) -> bool:
        return isinstance(other, (Tokens, tuple)) and len(other) == self.n and tuple(self) == tuple(other)

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"Tokens({len(self.prompt)} prompt, {self.n_out} outputs, {self.extra} in flight)"


class RequestView(NamedTuple):
    """One request as the next step finds it. Immutable, made per request per step: a NamedTuple
    (cheaper to make than a frozen dataclass) over `Tokens` (O(1), not O(length))."""

    id: str
    arrival: float
    num_prompt: int
    computed: int  # tokens whose state is in the pools once the step in flight commits
    ids: Sequence[int]  # prompt + outputs, the in-flight token as PLACEHOLDER (`Tokens`, or a tuple)
    params: SamplingParams
    seed: int
    indices: Mapping[str, tuple[int, ...]]  # page table, or (slot,), per component (an `IndexSnapshot`)

    @property
    def num_outputs(self) -> int:
        return len(self.ids) - self.num_prompt

    @property
    def pending(self) -> int:
        """Tokens known but not yet run through the model."""
        return len(self.ids) - self.computed

    def owned(self, name: str) -> int:
        """Units of component `name` this request holds (what retracting it gives back)."""
        return sum(1 for i in self.indices.get(name, ()) if i >= 0)


@dataclass(frozen=True)
class FreePool:
    count: int  # free units
    next: tuple[int, ...]  # the units allocation hands out next, in that order (a prefix of them: the scheduler
    # asks for a longer one, `NeedRoom.listed`, when a step takes more)


@dataclass(frozen=True)
class SchedulerView:
    step: int
    running: tuple[RequestView, ...]
    waiting: tuple[RequestView, ...]  # queue order (only as many as could be admitted)
    free: Mapping[str, FreePool]
    in_flight: frozenset[str] = frozenset()  # run by the step in flight; frees wait for it
    admit_new: bool = True  # False while retracted requests wait to resume: they go first
    reserve_ratio: float = 0.0  # adaptive admission: raised by memory pressure
    # running requests decoding on from last step without a view (lane.py), already advanced;
    # `running` leaves them out
    lane: LaneRows | None = None
    # requests offered to another replica hold units that come back without a retraction (the
    # importer acknowledges, or the lease ends): a request short of room waits for them
    offers_held: bool = False
    # a prefill replica's requests it decodes itself (it took back a hand-off no decode replica
    # took); it only prefills the others
    decodes_here: frozenset[str] = frozenset()

    @property
    def num_running(self) -> int:
        return len(self.running) + (len(self.lane.block) if self.lane is not None else 0)


def view_of(req: Request, ahead: tuple[int, bool] | None = None) -> RequestView:
    """`req` as the next step finds it. `ahead`, for a request the step in flight runs: (its
    computed length once that step commits, whether that step samples a token for it). O(1) in
    the request's length (`Tokens`), and in its indices while they do not change (their snapshot)."""
    have = len(req.output_ids)
    computed, extra = (req.num_computed, 0) if ahead is None else ahead
    idx = req.indices
    snap = idx.snapshot() if type(idx) is IndexTable else IndexSnapshot({n: tuple(u) for n, u in idx.items()})
    return RequestView(req.id, req.arrival, len(req.prompt_ids), computed,
                       Tokens(req.prompt_ids, req.output_ids, have, extra), req.params, req.seed, snap)


def build_view(step: int, running: list[Request], waiting: list[Request], alloc: dict[str, IndexAllocator],
               in_flight: StepPlan | None, max_running: int, max_units: int, admit_new: bool,
               reserve_ratio: float, lane: LaneRows | None = None, lane_reqs: Sequence[Request] = (),
               offers_held: bool = False, held: Callable[[Request], bool] | None = None,
               decodes_here: frozenset[str] = frozenset()) -> SchedulerView:
    """A snapshot of the request table and the allocators. `max_units`: how many of each pool's
    free units to list, in the order allocation hands them out (a step's tokens need at most
    one page each; a prefix-cache hit's window pages come on top: a step that takes more than
    is listed asks again, `NeedRoom.listed`). `lane`: rows of
    running requests planned without a view; `lane_reqs`, those requests (running, each once).
    `held`: requests that sit this step out (their grammar is not compiled yet), running or
    waiting; they still count toward `max_running`. `decodes_here`: SchedulerView's."""
    rest = running  # the lane's requests have no view; when the lane holds every running request, none has
    if lane_reqs:
        lane_ids = set(map(id, lane_reqs)) if len(lane_reqs) < len(running) else None
        rest = [r for r in running if id(r) not in lane_ids] if lane_ids is not None else []
    ahead = {}
    if in_flight is not None and rest:
        ahead = {e.req_id: (e.start + len(e.token_ids), e.sample is not None) for e in in_flight.entries}
        block = in_flight.decode
        if block is not None:
            ahead.update(zip(block.req_ids, zip((block.starts + 1).tolist(), repeat(True))))
    room = max(max_running - len(running), 0) if admit_new else 0
    if held is not None:
        rest = [r for r in rest if not held(r)]
        waiting = [r for r in waiting if not held(r)]
    return SchedulerView(
        step=step,
        running=tuple([view_of(r, ahead.get(r.id)) for r in rest]),
        waiting=tuple([view_of(r) for r in waiting[:room]]),
        free={n: FreePool(a.num_free, tuple(a.peek(max_units))) for n, a in alloc.items()},
        in_flight=frozenset(in_flight.req_ids) if in_flight is not None else frozenset(),
        admit_new=admit_new, reserve_ratio=reserve_ratio, lane=lane, offers_held=offers_held,
        decodes_here=decodes_here,
    )
