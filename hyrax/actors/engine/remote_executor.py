"""Executor over TP rank actors: every call fans out concurrently, one wait per call, with a
timeout, so a dead or hung rank surfaces as `RankFailure` instead of a hang.

Ray-typed objects are passed in (handles, a `get` function), keeping this module importable
without Ray.
"""
from __future__ import annotations

from hyrax.actors.engine.plan import StepPlan


class RankFailure(RuntimeError):
    """A rank died, hung past the timeout, or raised."""


class RemoteExecutor:
    def __init__(self, ranks: list, get, timeout_s: float):
        self.ranks = ranks
        self._get = get  # ray.get
        self.timeout_s = timeout_s
        self.num_ranks = len(ranks)

    def _all(self, method: str, *args) -> list:
        refs = [getattr(r, method).remote(*args) for r in self.ranks]
        try:
            return self._get(refs, timeout=self.timeout_s)
        except Exception as e:  # RayActorError, GetTimeoutError, task errors
            raise RankFailure(f"{method} failed on a rank: {type(e).__name__}: {e}") from e

    def execute(self, plan: StepPlan) -> list[int]:
        return self._all("execute", plan)[0]

    def submit(self, plan: StepPlan) -> list:
        """Send a step to every rank without waiting (ranks run calls in submission order)."""
        return [r.execute.remote(plan) for r in self.ranks]

    def collect(self, refs: list) -> list[int]:
        try:
            return self._get(refs, timeout=self.timeout_s)[0]
        except Exception as e:
            raise RankFailure(f"execute failed on a rank: {type(e).__name__}: {e}") from e

    def backup(self, req_id, rows, host_rows) -> dict[int, dict[str, int]]:
        return dict(enumerate(self._all("backup", req_id, rows, host_rows)))

    def restore(self, req_id, rows, host_rows) -> dict[int, dict[str, int]]:
        return dict(enumerate(self._all("restore", req_id, rows, host_rows)))

    def export(self, req_id, rows) -> tuple[dict[int, dict[str, int]], list]:
        """Checksums come back now; the shards stay in the object store, as refs."""
        pairs = [r.export.options(num_returns=2).remote(req_id, rows) for r in self.ranks]
        try:
            sums = self._get([p[0] for p in pairs], timeout=self.timeout_s)
        except Exception as e:
            raise RankFailure(f"export failed on a rank: {type(e).__name__}: {e}") from e
        return dict(enumerate(sums)), [p[1] for p in pairs]

    def import_(self, req_id, rows, expect, payload: list) -> dict[int, dict]:
        refs = [r.import_state.remote(req_id, rows, expect, *payload) for r in self.ranks]
        try:
            return dict(enumerate(self._get(refs, timeout=self.timeout_s)))
        except Exception as e:
            raise RankFailure(f"import failed on a rank: {type(e).__name__}: {e}") from e

    def discard(self, req_id) -> None:
        self._all("discard", req_id)

    def num_backups(self) -> dict[int, int]:
        return dict(enumerate(self._all("num_backups")))
