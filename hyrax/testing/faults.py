"""Fault injection for tests and mutation checks, kept out of the production path.

`EngineConfig.faults` (refused unless `allow_unsafe`) selects these at construction
(`moves.make_moves`): the production classes have no fault branches.

- `restore_into_old_indices`: a restore writes the rows the request held before retraction,
  not its new ones (the ownership check must catch it).
- `disable_verification`: loads trust the saved state: no completeness, ownership or
  checksum check (to show that those checks are what catches a bad backup or transfer).
"""
from __future__ import annotations

from hyrax.actors.engine.manifest import Manifest
from hyrax.actors.engine.moves import Backup, Rows, StateMoves
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
