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
log = logging.getLogger("hyrax.controller")


@dataclass(frozen=True)
class DeploymentEvent:
    at: float  # seconds since the epoch
    what: str

    def as_dict(self) -> dict:
        return {"time": self.at, "event": self.what}


@dataclass(frozen=True)
class EventPage:
    """The log as a gateway shows it: the newest events, oldest first, and how many there were."""
    events: tuple[DeploymentEvent, ...]
    total: int

    def as_dict(self) -> dict:
        return {"events": [e.as_dict() for e in self.events], "total": self.total,
                "dropped": self.total - len(self.events)}


class EventLog:
    def __init__(self, keep: int = KEEP, clock=time.time):
        if keep < 1:
            raise ValueError("an event log keeps at least one event")
        self._events: deque[DeploymentEvent] = deque(maxlen=keep)
        self._clock = clock
        self.total = 0

    def add(self, what: str) -> DeploymentEvent:
        event = DeploymentEvent(self._clock(), what)
        self._events.append(event)
        self.total += 1
        log.warning("deployment event: %s", what)
        return event

    def texts(self) -> list[str]:
        return [e.what for e in self._events]

    def page(self) -> EventPage:
        return EventPage(tuple(self._events), self.total)
