"""Executor over a replica's TP rank actors (Ray): every call fans out concurrently, one wait
per call, with a timeout, so a dead or hung rank surfaces as `RankFailure` instead of a hang."""
from __future__ import annotations

import ray

from hyrax.actors.engine.executor import RankCalls, RankFailure, StepResult
from hyrax.actors.engine.plan import StepPlan


class RayExecutor(RankCalls):
    def __init__(self, ranks: list, timeout_s: float):
        self.ranks = ranks  # the coordinator replaces them in place after a rank failure
        self.timeout_s = timeout_s
        self.num_ranks = len(ranks)

    def _wait(self, what: str, refs: list) -> list:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except Exception as e:  # RayActorError, GetTimeoutError, task errors
            raise RankFailure(f"{what} failed on a rank: {type(e).__name__}: {e}") from e

    def _each(self, method: str, *args) -> list:
        return self._wait(method, [getattr(r, method).remote(*args) for r in self.ranks])

    def _export(self, req_id, rows) -> tuple[list, list]:
        """Checksums come back now; the shards stay in the object store, as refs."""
        pairs = [r.export.options(num_returns=2).remote(req_id, rows) for r in self.ranks]
        return self._wait("export", [p[0] for p in pairs]), [p[1] for p in pairs]

    def submit(self, plan: StepPlan) -> list:
        """Send a step to every rank without waiting (ranks run calls in submission order)."""
        return [r.execute.remote(plan) for r in self.ranks]

    def collect(self, refs: list) -> StepResult:
        return StepResult.of(self._wait("execute", refs)[0])
