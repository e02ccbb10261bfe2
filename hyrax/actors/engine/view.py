"""The scheduler's input: an immutable view of a replica as the next step will find it.

The step in flight is already folded in: a request it runs is seen with the tokens that step
computes and the token it samples (as `PLACEHOLDER`, which the ranks fill in). Nothing here
is read back from live request fields while the scheduler plans.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.request import Request, SamplingParams

PLACEHOLDER = -1  # "the token this request samples in the step still in flight" (ranks fill it in)


@dataclass(frozen=True)
class RequestView:
    id: str
    arrival: float
    num_prompt: int
    computed: int  # tokens whose state is in the pools once the step in flight commits
    ids: tuple[int, ...]  # prompt + outputs, the in-flight token as PLACEHOLDER
    params: SamplingParams
    seed: int
    indices: Mapping[str, tuple[int, ...]]  # page table, or (slot,), per component

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
    next: tuple[int, ...]  # the units allocation hands out next, in that order (a prefix of them)


@dataclass(frozen=True)
class SchedulerView:
    step: int
    running: tuple[RequestView, ...]
    waiting: tuple[RequestView, ...]  # queue order (only as many as could be admitted)
    free: Mapping[str, FreePool]
    in_flight: frozenset[str] = frozenset()  # run by the step in flight; frees wait for it
    admit_new: bool = True  # False while retracted requests wait to resume: they go first
    reserve_ratio: float = 0.0  # adaptive admission: raised by memory pressure


def view_of(req: Request, ahead: tuple[int, int] | None = None) -> RequestView:
    """`req` as the next step finds it; `ahead` = (computed, outputs) once the step in flight commits."""
    computed, n_out = ahead if ahead is not None else (req.num_computed, len(req.output_ids))
    ids = (*req.prompt_ids, *req.output_ids, *(PLACEHOLDER,) * (n_out - len(req.output_ids)))
    return RequestView(req.id, req.arrival, len(req.prompt_ids), computed, ids, req.params, req.seed,
                       {name: tuple(idx) for name, idx in req.indices.items()})


def build_view(step: int, running: list[Request], waiting: list[Request], alloc: dict[str, IndexAllocator],
               in_flight: StepPlan | None, max_running: int, max_units: int, admit_new: bool,
               reserve_ratio: float) -> SchedulerView:
    """A snapshot of the request table and the allocators. `max_units`: the most units one step
    can take from a pool (a prefix of each free list that long is enough)."""
    ahead: dict[str, tuple[int, int]] = {}
    if in_flight is not None:
        by_id = {r.id: r for r in running}
        for e in in_flight.entries:
            if e.req_id in by_id:
                ahead[e.req_id] = (e.end, len(by_id[e.req_id].output_ids) + (e.sample is not None))
    room = max(max_running - len(running), 0) if admit_new else 0
    return SchedulerView(
        step=step,
        running=tuple(view_of(r, ahead.get(r.id)) for r in running),
        waiting=tuple(view_of(r) for r in waiting[:room]),
        free={n: FreePool(a.num_free, tuple(a.peek(max_units))) for n, a in alloc.items()},
        in_flight=frozenset(e.req_id for e in in_flight.entries) if in_flight is not None else frozenset(),
        admit_new=admit_new, reserve_ratio=reserve_ratio,
    )
