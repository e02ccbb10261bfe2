"""The step in flight and the one free point.

With a pipeline of depth 2 the ranks may still be running step N (and writing its rows) when
the engine releases a request's indices. `InFlight` holds that step as a value and defers
every release until the step that may still write the rows is committed; with nothing in
flight a release frees at once. Every reason a request gives up device state comes here.
"""
from __future__ import annotations

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.plan import StepPlan


class InFlight:
    def __init__(self, allocators: dict[str, IndexAllocator]):
        self.alloc = allocators  # the engine's dict (replaced in place on recovery)
        self.step: tuple[StepPlan, object] | None = None  # (plan, executor handle)
        self.frees: list[tuple[int, str, dict[str, list[int]]]] = []  # (step it waits for, owner, indices)

    @property
    def plan(self) -> StepPlan | None:
        return self.step[0] if self.step is not None else None

    def ids(self) -> set[str]:
        """Requests the step in flight runs."""
        return set(self.step[0].req_ids) if self.step is not None else set()

    def swap(self, step: tuple[StepPlan, object] | None) -> tuple[StepPlan, object] | None:
        """`step` is in flight now; returns the one that was."""
        prev, self.step = self.step, step
        return prev

    def deferred_owners(self) -> set[str]:
        return {owner for _, owner, _ in self.frees}

    def deferred_units(self, owner: str) -> dict[str, list[int]]:
        """Units of `owner` whose free waits for the step in flight, per pool."""
        out: dict[str, list[int]] = {}
        for _, who, indices in self.frees:
            if who == owner:
                for name, idx in indices.items():
                    out.setdefault(name, []).extend(idx)
        return out

    def release(self, owner: str, indices: dict[str, list[int]]) -> None:
        """Give device indices back: now, or after the step in flight."""
        indices = {n: [i for i in idx if i >= 0] for n, idx in indices.items()}
        if self.step is not None:
            self.frees.append((self.step[0].step, owner, indices))
        else:
            self._free(owner, indices)

    def committed(self, done_step: int) -> None:
        """Step `done_step` is committed: the frees that waited for it happen now."""
        keep = []
        for waits_for, owner, indices in self.frees:
            if waits_for <= done_step:
                self._free(owner, indices)
            else:
                keep.append((waits_for, owner, indices))
        self.frees = keep

    def forget(self) -> None:
        """The ranks were lost: no step is in flight and nothing waits to be freed."""
        self.step, self.frees = None, []

    def _free(self, owner: str, indices: dict[str, list[int]]) -> None:
        for name, idx in indices.items():
            if idx:
                self.alloc[name].free(owner, idx)
