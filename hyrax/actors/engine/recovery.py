"""When running a step goes wrong: the engine's answers to a failed step and to lost ranks.

- A step that raised on live ranks (`StepError`): the requests of that step, and of the step
  submitted after it (it read their rows), end with `error`; the ranks and every other
  request carry on.
- A step that ran out of device memory (`StepOutOfMemory`): the batch cap is lowered
  (batch_cap.py) and the requests of that step and of the step after it go back to the front
  of the queue, rebuilt by prefill from their tokens: the failed forward may have written part
  of their state (a recurrent state advanced in some layers, not in others), so none of it is
  kept. Only a step already as small as a step can be fails its request with `error`.
- A step whose prefix-cache hit failed its check on a rank (`StepCorruptHit`: the checkpoint
  changed since it was cached; every rank raised before writing anything): those hits are
  revoked (their nodes never matched again) and the requests of that step and of the step
  after it are rebuilt by prefill, as after running out of memory; no request fails.
- Ranks lost and restarted with empty pools: every request keeps its tokens and is rebuilt
  by prefill (recompute), except an offered one, which its importer takes from the offer; or,
  when the ranks are gone for good, every request ends.
"""
from __future__ import annotations

import logging
from typing import Callable

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.batch_cap import BatchCap
from hyrax.actors.engine.executor import Executor, StepCorruptHit, StepError, StepOutOfMemory
from hyrax.actors.engine.indices import IndexTable
from hyrax.actors.engine.inflight import InFlight
from hyrax.actors.engine.lifecycle import RequestTable
from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.request import Request, State
from hyrax.actors.engine.stats import EngineStats

log = logging.getLogger("hyrax.engine")


class Recovery:
    def __init__(self, table: RequestTable, inflight: InFlight, executor: Executor, stats: EngineStats,
                 alloc: dict[str, IndexAllocator], host_alloc: dict[str, IndexAllocator],
                 finish: Callable[[Request, str], None], reset: Callable[[], None],
                 free_device: Callable[[Request], None], cap: BatchCap,
                 revoke_hits: Callable[[tuple[str, ...]], None] = lambda ids: None,
                 release_backup: Callable[[Request], None] = lambda req: None,
                 leave: Callable[[Request, str], None] = lambda req, reason: None):
        self.table, self.inflight, self.executor, self.stats = table, inflight, executor, stats
        self.alloc, self.host_alloc = alloc, host_alloc
        self.finish = finish  # the engine's end of a request (frees through the one free point)
        self.reset = reset  # the engine forgets what its pipeline carried between steps
        self.free_device = free_device  # gives back a request's device units (the one free point)
        self.cap = cap
        self.revoke_hits = revoke_hits  # the prefix cache's answer to hits that failed their check
        self.release_backup = release_backup  # discards a retracted request's backup on the ranks
        self.leave = leave  # a request leaves the replica, not finished here (another replica has it)
        self.last_step_error: str | None = None

    def step_failed(self, plan: StepPlan, error: StepError) -> None:
        """`plan` raised on live ranks: end its requests, and those of the step in flight;
        out of memory: lower the batch cap and rebuild them instead."""
        self.last_step_error = str(error)
        log.warning("step %d failed (%d requests): %s", plan.step, plan.num_rows, error)
        later = self._collect_later(plan)
        if isinstance(error, StepCorruptHit):  # nothing was written: only the hits were wrong
            self.revoke_hits(error.req_ids)
            self._rebuild(plan, *later)
            return
        if not isinstance(error, StepOutOfMemory):
            self.stats.step_errors += 1
            self._fail(plan, *later)
            return
        self.stats.batch_cap.out_of_memory_steps += 1
        if self.cap.smallest(plan):  # alone and as small as a step can be: retrying cannot help
            self.stats.batch_cap.failed += plan.num_rows
            self._fail(plan)
            self._rebuild(*later)
            return
        self.cap.shrink(plan)
        self._rebuild(plan, *later)

    def _collect_later(self, plan: StepPlan) -> tuple[StepPlan, ...]:
        """The step submitted after the failed `plan` (it read their rows) is collected and its
        result dropped; the frees waiting for either step happen now. Returns its plan, if any."""
        later = self.inflight.swap(None)
        if later is not None:
            try:
                self.executor.collect(later[1])
            except StepError:
                pass
        self.inflight.committed(max(plan.step, later[0].step) if later is not None else plan.step)
        return (later[0],) if later is not None else ()

    def _fail(self, *plans: StepPlan) -> None:
        for plan in plans:
            for rid in plan.req_ids:
                req = self.table.get(rid)
                if req is not None:
                    self.finish(req, "error")

    def _rebuild(self, *plans: StepPlan) -> None:
        """The plans' running requests give back their device state (which the failed step
        may have half written) and wait first in line, to be rebuilt by prefill from their
        tokens; nothing they committed is lost."""
        for plan in plans:
            for rid in plan.req_ids:
                req = self.table.get(rid)
                if req is None or req.state != State.RUNNING:
                    continue  # finished or aborted (its rows went then), or rebuilt already
                self.free_device(req)
                req.num_computed = 0
                self.table.requeue(req)
                self.stats.batch_cap.rebuilt += 1

    def reset_for_recovery(self) -> list[str]:
        """After the ranks were lost and restarted with empty pools: every request keeps its
        tokens and is rebuilt by prefill (recompute). Returns the ids affected. An offered request
        is its importer's now (its stream here ended with the hand-off, whose tokens let the
        importer rebuild it if the state is gone): it leaves, as when its lease ends."""
        for req in list(self.table.offered.values()):
            self.leave(req, "lease_expired")
            self.stats.offers_reclaimed += 1
        live = self._drop_all_state()
        self.stats.recoveries += 1
        return [r.id for r in live]

    def fail_all(self, reason: str = "error", ranks_alive: bool = False) -> list[str]:
        """Finish every unfinished request (ranks gone for good); nothing stays queued.
        `ranks_alive`: the ranks stay (an engine error, no rank lost): the backups they hold
        for retracted requests are discarded first, or they would keep them for good."""
        if ranks_alive:
            for req in list(self.table.retracted):
                try:
                    self.release_backup(req)
                except Exception:  # noqa: BLE001 - failing the requests must not fail
                    log.exception("discarding the backup of %s failed", req.id)
        self._drop_all_state()
        ids = list(self.table.requests)
        for rid in ids:
            self.finish(self.table.get(rid), reason)
        return ids

    def _drop_all_state(self) -> list[Request]:
        """Forget every index, backup and step in flight; every live request back to waiting (a
        held retracted one stays retracted, with no backup: its resume recomputes it)."""
        self.inflight.forget()
        self.reset()
        live = self.table.rebuild_all()
        for req in live:
            req.indices, req.backup, req.num_computed, req.export_payload = IndexTable(), None, 0, None
        # in place: the state mover and the free point hold these same dicts
        self.alloc.update({n: IndexAllocator(n, a.capacity) for n, a in self.alloc.items()})
        self.host_alloc.update({n: IndexAllocator(a.name, a.capacity) for n, a in self.host_alloc.items()})
        return live
