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
- `corrupt_backup_component`: a save flips one bit of this component after hashing it (the
  exponent's top bit of its last value).
- `step_delay_ms`: every step sleeps this long first (a slow device: requests stay in flight
  for a known time; the tokens do not change).
"""
from __future__ import annotations

import time

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
        if self.faults.step_delay_ms:
            time.sleep(self.faults.step_delay_ms / 1000.0)
        n = self.faults.step_error_at_context
        if n and any(e.end >= n for e in plan.all_entries()):
            raise RuntimeError(f"injected step error: a request reached {n} tokens of context")
        return super().execute(plan)

    def _checksummed(self, name: str, data: torch.Tensor) -> None:
        # data: (layers, rows, *unit), contiguous. Bit 6 of the last byte is the exponent's top bit
        # of the newest row's last value (fp32 and bf16, little endian): a value below 2 becomes
        # ~1e38, in a row the next step reads. (Flipping the first byte changed the low mantissa
        # of the oldest row, which may have left the window: the outputs did not change.)
        if name == self.faults.corrupt_backup_component and data.numel():
            data.view(-1).view(torch.uint8)[-1] ^= 0x40


# ---- a replica that hangs: alive to Ray, answering nothing ---------------------------------
# Not an engine fault: no production class is swapped for it. The test freezes the process of an
# actor (a coordinator: its loop, its health answers, its streams all stop) as a deadlocked or
# swapped-out process would be; Ray still counts the actor alive, so only a health check with a
# timeout can tell. Run from a Ray driver on the machine that hosts the actor.

def actor_pid(actor) -> int:
    """The pid of `actor`'s process, from Ray's actor table (no call to the actor itself)."""
    import ray

    # private: the public actor table (ray.util.state) needs the dashboard, which clusters may run without
    info = ray._private.state.actors(actor._actor_id.hex())
    if info.get("State") != "ALIVE" or not info.get("Pid"):
        raise RuntimeError(f"actor {actor._actor_id.hex()} has no live process ({info.get('State')})")
    return int(info["Pid"])


def hang_actor(actor, *, allow_unsafe: bool = False) -> int:
    """Freeze `actor`'s process with SIGSTOP (test-only: refused unless `allow_unsafe`, like every
    fault here). Returns its pid; SIGCONT ends the hang, and killing the actor ends the process."""
    import os
    import signal

    from hyrax.actors.model.errors import HyraxInputError

    if not allow_unsafe:
        raise HyraxInputError("hanging an actor is test-only fault injection: pass the explicit unsafe switch")
    pid = actor_pid(actor)
    os.kill(pid, signal.SIGSTOP)
    return pid
