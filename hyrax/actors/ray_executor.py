"""Executor over a replica's TP rank actors (Ray): every call fans out concurrently, one wait
per call, with a timeout, so a dead or hung rank surfaces as `RankFailure` instead of a hang."""
from __future__ import annotations

from dataclasses import replace

import ray

from hyrax.actors.engine.executor import RankCalls, RankFailure, Sums, step_error
from hyrax.actors.engine.moves import Location, Place, Rows
from hyrax.actors.engine.plan import StepPlan, StepResult


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

    def save(self, req_id: str, rows: Rows, location: Location) -> tuple[Sums, list | None]:
        """To the object store: checksums come back now, the shards stay there, as refs."""
        if location.place != Place.OBJECT_STORE:
            return super().save(req_id, rows, location)
        pairs = [r.save.options(num_returns=2).remote(req_id, rows, location) for r in self.ranks]
        return dict(enumerate(self._wait("save", [p[0] for p in pairs]))), [p[1] for p in pairs]

    def load(self, req_id: str, rows: Rows, location: Location, expect: Sums) -> dict[int, dict]:
        """Shard refs travel as arguments of their own (RankWorker.load), so Ray fetches them."""
        shards = location.payload if location.place == Place.OBJECT_STORE else ()
        return dict(enumerate(self._each("load", req_id, rows, replace(location, payload=None), expect, *shards)))

    def submit(self, plan: StepPlan) -> list:
        """Send a step to every rank without waiting (ranks run calls in submission order)."""
        return [r.execute.remote(plan) for r in self.ranks]

    def collect(self, refs: list) -> StepResult:
        """Rank 0's result, with every rank's checkpoint checksums. A rank that raised while every rank answered is a StepError (the
        ranks live on); a rank that died, hung or left the others waiting is a RankFailure."""
        try:
            results = ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            answered, _ = ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout_s, 10.0))
            if len(answered) == len(refs) and not isinstance(e, ray.exceptions.RayActorError):
                raise step_error(e.cause, "a rank") from e  # an out-of-memory is its own type
            raise RankFailure(f"execute failed on a rank: {type(e).__name__}: {e}") from e
        except Exception as e:  # RayActorError, GetTimeoutError
            raise RankFailure(f"execute failed on a rank: {type(e).__name__}: {e}") from e
        return StepResult.gathered(results)
