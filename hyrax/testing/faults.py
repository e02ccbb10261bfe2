"""Fault injection for tests and mutation checks, kept out of the production path.

`EngineConfig.faults` (refused unless `allow_unsafe`) selects these at construction
(`moves.make_moves` on the coordinator, `rank_runtime.make_rank_runtime` on each rank): the
production classes have no fault branches.

Coordinator (`UnsafeMoves`):
- `restore_into_old_indices`: a restore writes the rows the request held before retraction,
  not its new ones (the ownership check must catch it).
- `disable_verification`: loads trust the saved state: no completeness, ownership or
  checksum check (to show that those checks are what catches a bad backup or transfer).

Rank (`UnsafeRankRuntime`, on `only_rank` or every rank):
- `skip_backup_component`: a save (backup or export) silently leaves these components out.
- `corrupt_backup_component`: a save flips a byte of this component after checksumming it.
"""
from __future__ import annotations

import torch

from hyrax.actors.engine.config import UnsafeFaults
from hyrax.actors.engine.manifest import Manifest
from hyrax.actors.engine.moves import Backup, Rows, StateMoves
from hyrax.actors.engine.rank_runtime import RankRuntime
from hyrax.actors.engine.request import Request
from hyrax.actors.engine.statecopy import live_rows


class UnsafeMoves(StateMoves):
    def target_rows(self, req: Request, backup: Backup) -> Rows:
        if not (self.config.faults.restore_into_old_indices and backup.location.here):
            return super().target_rows(req, backup)
        m = backup.manifest
        out = {}
        for c in self.components:
            rec = m.components.get(c.name)
            old = self.page_table(c, rec.indices, m.num_tokens) if rec else []
            out[c.name] = live_rows(c, old, m.num_tokens, self.config.page_size) if old else []
        return out

    def precheck(self, req: Request, m: Manifest, target: Rows) -> None:
        if not self.config.faults.disable_verification:
            super().precheck(req, m, target)

    def verified(self, results: dict[int, dict]) -> bool:
        return self.config.faults.disable_verification or super().verified(results)


class UnsafeRankRuntime(RankRuntime):
    def __init__(self, faults: UnsafeFaults, *args):
        super().__init__(*args)
        self.faults = faults

    def _saving(self):
        return tuple(c for c in self.components if c.name not in self.faults.skipped)

    def execute(self, plan):
        n = self.faults.step_error_at_context
        if n and any(e.end >= n for e in plan.entries):
            raise RuntimeError(f"injected step error: a request reached {n} tokens of context")
        return super().execute(plan)

    def _checksummed(self, name: str, data: torch.Tensor) -> None:
        if name == self.faults.corrupt_backup_component and data.numel():
            data.view(torch.uint8).view(-1)[0] ^= 0xFF
