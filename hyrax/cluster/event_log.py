"""The deployment controller's event log: what it did to the replicas and why (a replica lost,
hung or down and stopped, a replacement placed or failed, a replica added, retired or removed by
the autoscaler, the controller itself restarted), each with the wall-clock time it happened.

A replica the controller replaced leaves the gateway's views with it (`/admin/health` lists the
replicas that serve now), so this log is where an operator reads what happened to it:
`GET /admin/events` (admin token), `hyrax admin events`. It is kept in the controller's memory,
bounded to the newest `KEEP` events (`total` counts every one since the controller started), and
each event is also logged by the controller. A restarted controller starts a new log, whose
first event says it took its replicas back. Ray-free.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

KEEP = 1000
# what an event is about: a replica the controller stopped (its coordinator died, it hung, its
# ranks could not be kept alive), a replacement placed or failed, the autoscaler's steps, and the
# controller's own restart
KINDS = ("dead", "hung", "down", "replaced", "replace_failed", "added", "retiring", "removed", "restarted")
log = logging.getLogger("hyrax.controller")


@dataclass(frozen=True)
class DeploymentEvent:
    at: float  # seconds since the epoch
    kind: str  # one of KINDS
    what: str  # the event in words, naming the replicas

    def as_dict(self) -> dict:
        return {"time": self.at, "kind": self.kind, "event": self.what}


@dataclass(frozen=True)
class EventPage:
    """The log as a gateway shows it: the newest events, oldest first, how many there were, and
    how many of each kind (every kind listed, since the controller started: /metrics' counters)."""
    events: tuple[DeploymentEvent, ...]
    total: int
    counts: tuple[tuple[str, int], ...]

    def as_dict(self) -> dict:
        return {"events": [e.as_dict() for e in self.events], "total": self.total,
                "dropped": self.total - len(self.events), "counts": dict(self.counts)}


class EventLog:
    def __init__(self, keep: int = KEEP, clock=time.time):
        if keep < 1:
            raise ValueError("an event log keeps at least one event")
        self._events: deque[DeploymentEvent] = deque(maxlen=keep)
        self._clock = clock
        self._counts = dict.fromkeys(KINDS, 0)
        self.total = 0

    def add(self, kind: str, what: str) -> DeploymentEvent:
        if kind not in self._counts:
            raise ValueError(f"unknown deployment event kind {kind!r}; one of {', '.join(KINDS)}")
        event = DeploymentEvent(self._clock(), kind, what)
        self._events.append(event)
        self._counts[kind] += 1
        self.total += 1
        log.warning("deployment event: %s", what)
        return event

    def texts(self) -> list[str]:
        return [e.what for e in self._events]

    def page(self) -> EventPage:
        return EventPage(tuple(self._events), self.total, tuple(self._counts.items()))
