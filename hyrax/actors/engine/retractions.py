"""Retraction and restore as the request table sees them: a state move (moves.py) and the
transition that goes with it, in that order, for one request or for an operator's list.

None of these may run on a request with a step in flight: the engine commits that step first.
"""
from __future__ import annotations

from hyrax.actors.engine.lifecycle import Outcome, RequestTable
from hyrax.actors.engine.moves import Place, StateMoves
from hyrax.actors.engine.request import Request, State
from hyrax.actors.model.errors import HyraxInputError

MODES = frozenset({Place.RANK_MEMORY.value, Place.HOST_POOL.value, Outcome.RECOMPUTE.value})


class Retractions:
    def __init__(self, table: RequestTable, moves: StateMoves):
        self.table, self.moves = table, moves

    def retract(self, req: Request, trigger: str, mode: str | None, hold: bool, step: int) -> Outcome:
        """Save (or drop) a running request's state, free its device indices, mark it retracted
        at `step` (it does not resume in that same step). Returns the backup mode used."""
        used = self.moves.retract(req, trigger, mode)
        self.table.retract(req, hold)
        req.retracted_at_step = step
        return Outcome(used)

    def restore(self, req: Request) -> Outcome:
        """Load a retracted request's state into new indices: VERIFIED runs again, NO_CAPACITY
        stays retracted, anything else is rebuilt by prefill (first in line)."""
        result = self.moves.load(req)
        if result == Outcome.VERIFIED:
            self.table.restore(req)
        elif result != Outcome.NO_CAPACITY:
            self.table.requeue(req)
        return result

    def auto_resume(self, step: int) -> None:
        """Restore released requests, oldest first, until one does not fit."""
        for req in list(self.table.retracted):
            if req.hold or req.retracted_at_step == step:
                continue
            if self.restore(req) == Outcome.NO_CAPACITY:
                break  # keep order: the oldest retracted request goes first

    def retract_ids(self, req_ids: list[str], mode: str | None, hold: bool, trigger: str,
                    step: int) -> dict[str, Outcome]:
        """Id -> the backup mode used, or why not (unknown, not running)."""
        if mode is not None and mode not in MODES:
            raise HyraxInputError("mode must be cpu_tensor, host_pool or recompute")
        out = {}
        for rid in req_ids:
            req = self.table.get(rid)
            if req is None:
                out[rid] = Outcome.UNKNOWN
            elif req.state != State.RUNNING:
                out[rid] = Outcome.NOT_RUNNING
            else:
                out[rid] = self.retract(req, trigger, mode, hold, step)
        return out

    def resume_ids(self, req_ids: list[str]) -> dict[str, Outcome]:
        """Release held requests: restored now, or as soon as memory allows (QUEUED). The hold
        goes with the restore, not before: a rank lost in the load (RankFailure, raised) leaves
        the request held, as if the resume had not been asked for."""
        out = {}
        for rid in req_ids:
            req = self.table.get(rid)
            if req is None or req.state != State.RETRACTED:
                out[rid] = Outcome.NOT_RETRACTED if req is not None else Outcome.UNKNOWN
                continue
            result = self.restore(req)
            if result == Outcome.NO_CAPACITY:
                self.table.release(req)
            out[rid] = Outcome.QUEUED if result == Outcome.NO_CAPACITY else result
        return out
