"""The request table: every request of a replica by id and by state, and the only place a
request's state changes.

    (new) --admit--> WAITING --start--> RUNNING --retract--> RETRACTED --restore--> RUNNING
                        ^                  |                     |
                        +----requeue-------+---------------------+   (rebuilt by prefill)
    (new) --import--> RETRACTED            +--offer--> OFFERED --(acknowledged / lease over)--> gone
                                               RUNNING <--take back-- OFFERED   (no replica took it)
    any live state --finish--> FINISHED (removed from the table)

An illegal transition raises `IllegalTransition`: a caller that asks to retract a waiting
request, or to offer one that is not running, is a bug, not a case to skip silently.
"""
from __future__ import annotations

import enum
import time

from hyrax.actors.engine.request import Request, State


class IllegalTransition(RuntimeError):
    """A state change the lifecycle does not allow."""


class Outcome(str, enum.Enum):
    """Typed result of an operation on one request, from the engine up to the API. A str enum:
    it compares equal to its value and serialises as it."""

    # retraction: the backup mode used
    CPU_TENSOR = "cpu_tensor"
    HOST_POOL = "host_pool"
    RECOMPUTE = "recompute"
    # restore / import / resume
    VERIFIED = "verified"
    QUEUED = "queued"  # resume: released, restored as soon as memory allows
    NO_CAPACITY = "no_capacity"
    FALLBACK = "fallback"  # state incomplete or a copy failed: rebuilt by prefill
    CHECKSUM_MISMATCH = "checksum_mismatch"  # rebuilt by prefill
    MIGRATING = "migrating"
    TAKEN_BACK = "taken_back"  # an offer no other replica took: the source runs it on (its state never left)
    # refusals
    UNKNOWN = "unknown_request"
    NOT_RUNNING = "not_running"
    NOT_RETRACTED = "not_retracted"
    NO_TARGET = "no_other_replica"
    ALREADY_THERE = "already_on_replica"  # migrate: the target named is the request's own replica
    # a rank failed during the command: the replica recovered, every request rebuilt from its tokens
    # (a held one stays held; its resume recomputes it)
    RANKS_FAILED = "ranks_failed"

    @property
    def ok(self) -> bool:
        return self not in _REFUSALS

    @property
    def message(self) -> str:
        return self.value.replace("_", " ")


_REFUSALS = frozenset({Outcome.UNKNOWN, Outcome.NOT_RUNNING, Outcome.NOT_RETRACTED, Outcome.NO_TARGET,
                       Outcome.ALREADY_THERE, Outcome.RANKS_FAILED})


class RequestTable:
    def __init__(self):
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # FIFO; rebuilt requests go first
        self.running: list[Request] = []
        self.retracted: list[Request] = []  # oldest first: the order they resume in
        self.offered: dict[str, Request] = {}  # exported, waiting for the importer's acknowledgement

    # ---- queries ---------------------------------------------------------------------
    def get(self, req_id: str) -> Request | None:
        return self.requests.get(req_id)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self.requests

    def __len__(self) -> int:
        return len(self.requests)

    def counts(self) -> dict[str, int]:
        return {"running": len(self.running), "waiting": len(self.waiting), "retracted": len(self.retracted),
                "handoff": len(self.offered)}

    def expired_offers(self, now: float) -> list[Request]:
        return [r for r in self.offered.values() if r.offer_deadline is not None and r.offer_deadline <= now]

    # ---- transitions -----------------------------------------------------------------
    def _move(self, req: Request, frm: tuple[State, ...], to: State) -> None:
        if req.state not in frm or self.requests.get(req.id) is not req:
            raise IllegalTransition(f"{req.id}: {req.state.value} -> {to.value} is not allowed")
        if req.state == State.OFFERED:
            del self.offered[req.id]
        else:
            self._lists[req.state].remove(req)
        req.state = to
        if to == State.OFFERED:
            self.offered[req.id] = req
        else:
            self._lists[to].append(req)

    @property
    def _lists(self) -> dict[State, list[Request]]:
        return {State.WAITING: self.waiting, State.RUNNING: self.running, State.RETRACTED: self.retracted}

    def admit(self, req: Request) -> None:
        """A new request joins the queue."""
        self._enter(req, State.WAITING)

    def import_(self, req: Request) -> None:
        """A request handed over by another replica: retracted here until its state is imported."""
        self._enter(req, State.RETRACTED)

    def _enter(self, req: Request, state: State) -> None:
        if req.id in self.requests:
            raise IllegalTransition(f"request id {req.id!r} is already in the table")
        req.state = state
        self.requests[req.id] = req
        self._lists[state].append(req)

    def start(self, req: Request) -> None:
        """Admitted by the scheduler: its slots and first pages are allocated."""
        self._move(req, (State.WAITING,), State.RUNNING)

    def retract(self, req: Request, hold: bool) -> None:
        self._move(req, (State.RUNNING,), State.RETRACTED)
        req.hold = hold
        req.retractions += 1

    def release(self, req: Request) -> None:
        """An operator resumed a retracted request that does not fit yet: no longer held, it is
        restored as soon as memory allows."""
        if req.state != State.RETRACTED or self.requests.get(req.id) is not req:
            raise IllegalTransition(f"{req.id}: only a retracted request is released, not a {req.state.value} one")
        req.hold = False

    def restore(self, req: Request) -> None:
        """Its state is back in the device pools, verified."""
        self._move(req, (State.RETRACTED,), State.RUNNING)
        req.hold = False

    def requeue(self, req: Request) -> None:
        """Rebuilt by prefill from its tokens: first in line."""
        self._move(req, (State.RETRACTED, State.RUNNING, State.OFFERED, State.WAITING), State.WAITING)
        self.waiting.remove(req)
        self.waiting.insert(0, req)
        req.hold, req.offer_deadline = False, None

    def offer(self, req: Request, lease_s: float) -> None:
        """Exported to another replica; its state stays here until acknowledged or the lease ends."""
        self._move(req, (State.RUNNING,), State.OFFERED)
        req.offer_deadline, req.offer_carrier = time.monotonic() + lease_s, None

    def take_back(self, req: Request) -> None:
        """Its offer went nowhere (no other replica took it) and its client is still there: it runs
        on here, from the state it never stopped holding."""
        self._move(req, (State.OFFERED,), State.RUNNING)
        req.offer_deadline = None

    def finish(self, req: Request, reason: str) -> State:
        """Leave the table (finished, aborted, failed, or taken over by another replica).
        Returns the state it left, so the caller can release what that state held."""
        was = req.state
        if was == State.FINISHED or self.requests.get(req.id) is not req:
            raise IllegalTransition(f"{req.id}: already finished")
        if was == State.OFFERED:
            del self.offered[req.id]
        else:
            self._lists[was].remove(req)
        del self.requests[req.id]
        req.state, req.finish_reason = State.FINISHED, reason
        req.finished_at = time.monotonic()
        return was

    def rebuild_all(self) -> list[Request]:
        """Every live request back to waiting (its state is gone), oldest first; a retracted
        request an operator holds stays retracted and held (the operator's resume rebuilds it).
        Returns them all, the held ones last."""
        held = [r for r in self.retracted if r.hold]
        live = sorted(self.running + [r for r in self.retracted if not r.hold] + list(self.offered.values()),
                      key=lambda r: r.arrival)
        for req in live:
            req.state, req.hold, req.offer_deadline = State.WAITING, False, None
        self.waiting[:0] = live
        self.running.clear()
        self.retracted[:] = held
        self.offered.clear()
        return live + held
