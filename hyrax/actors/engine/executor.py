"""Executors fan a coordinator's calls out to its ranks and gather per-rank answers.

`LocalExecutor` runs one in-process rank (tp_size 1), for `hyrax generate` and unit tests;
the Ray roles provide the same interface over rank actors.
"""
from __future__ import annotations

from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.rank_runtime import RankRuntime, Rows


class LocalExecutor:
    def __init__(self, rank: RankRuntime):
        self.rank = rank
        self.num_ranks = 1

    def execute(self, plan: StepPlan) -> list[int]:
        return self.rank.execute(plan)

    def submit(self, plan: StepPlan):
        """Start a step; `collect` returns its tokens. In-process, it simply runs now."""
        return self.rank.execute(plan)

    def collect(self, handle) -> list[int]:
        return handle

    def backup(self, req_id: str, rows: Rows, host_rows: Rows | None) -> dict[int, dict[str, int]]:
        return {0: self.rank.backup(req_id, rows, host_rows)}

    def restore(self, req_id: str, rows: Rows, host_rows: Rows | None) -> dict[int, dict[str, int]]:
        return {0: self.rank.restore(req_id, rows, host_rows)}

    def discard(self, req_id: str) -> None:
        self.rank.discard(req_id)

    def export(self, req_id: str, rows: Rows) -> tuple[dict[int, dict[str, int]], list]:
        sums, payload = self.rank.export(req_id, rows)
        return {0: sums}, [payload]

    def import_(self, req_id: str, rows: Rows, expect: dict[int, dict[str, int]], payload: list) -> dict[int, dict]:
        return {0: self.rank.import_state(req_id, rows, expect, *payload)}

    def num_backups(self) -> dict[int, int]:
        return {0: self.rank.num_backups()}
