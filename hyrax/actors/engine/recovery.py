"""When running a step goes wrong: the engine's answers to a failed step and to lost ranks.

- A step that raised on live ranks (`StepError`): the requests of that step, and of the step
  submitted after it (it read their rows), end with `error`; the ranks and every other
  request carry on.
- Ranks lost and restarted with empty pools: every request keeps its tokens and is rebuilt
  by prefill (recompute); or, when the ranks are gone for good, every request ends.
"""
from __future__ import annotations

from typing import Callable

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.executor import Executor, StepError
from hyrax.actors.engine.inflight import InFlight
from hyrax.actors.engine.lifecycle import RequestTable
from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.request import Request
from hyrax.actors.engine.stats import EngineStats


class Recovery:
    def __init__(self, table: RequestTable, inflight: InFlight, executor: Executor, stats: EngineStats,
                 alloc: dict[str, IndexAllocator], host_alloc: dict[str, IndexAllocator],
                 finish: Callable[[Request, str], None], reset: Callable[[], None]):
        self.table, self.inflight, self.executor, self.stats = table, inflight, executor, stats
        self.alloc, self.host_alloc = alloc, host_alloc
        self.finish = finish  # the engine's end of a request (frees through the one free point)
        self.reset = reset  # the engine forgets what its pipeline carried between steps
        self.last_step_error: str | None = None

    def step_failed(self, plan: StepPlan, error: StepError) -> None:
        """`plan` raised on live ranks: end its requests, and those of the step in flight."""
        self.stats.step_errors += 1
        self.last_step_error = str(error)
        failed = {e.req_id for e in plan.entries}
        done = plan.step
        later = self.inflight.swap(None)
        if later is not None:
            try:
                self.executor.collect(later[1])
            except StepError:
                pass
            failed |= {e.req_id for e in later[0].entries}
            done = max(done, later[0].step)
        self.inflight.committed(done)
        for rid in failed:
            req = self.table.get(rid)
            if req is not None:
                self.finish(req, "error")

    def reset_for_recovery(self) -> list[str]:
        """After the ranks were lost and restarted with empty pools: every request keeps its
        tokens and is rebuilt by prefill (recompute). Returns the ids affected."""
        live = self._drop_all_state()
        self.stats.recoveries += 1
        return [r.id for r in live]

    def fail_all(self, reason: str = "error") -> list[str]:
        """Finish every unfinished request (ranks gone for good); nothing stays queued."""
        self._drop_all_state()
        ids = list(self.table.requests)
        for rid in ids:
            self.finish(self.table.get(rid), reason)
        return ids

    def _drop_all_state(self) -> list[Request]:
        """Forget every index, backup and step in flight; every live request back to waiting."""
        self.inflight.forget()
        self.reset()
        live = self.table.rebuild_all()
        for req in live:
            req.indices, req.backup, req.num_computed, req.export_payload = {}, None, 0, None
        # in place: the state mover and the free point hold these same dicts
        self.alloc.update({n: IndexAllocator(n, a.capacity) for n, a in self.alloc.items()})
        self.host_alloc.update({n: IndexAllocator(a.name, a.capacity) for n, a in self.host_alloc.items()})
        return live
