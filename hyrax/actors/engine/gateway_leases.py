"""Gateway leases: which open streams belong to which gateway, and which gateways stopped renewing.

A replica streams each request's tokens to the gateway that asked for it. When that gateway's
process dies (SIGKILL, a node lost) nothing tells the replica: over Ray, a streaming generator
whose caller is gone keeps running (measured: still yielding 20 s after the caller was killed).
So each gateway renews a lease on every replica it serves through, every third of the lease; a
replica whose gateway's lease ran out aborts that gateway's streams, which frees their state at
the loop's one free point like any other abort. Requests of other gateways are untouched.

Ray-free; the coordinator owns one and asks it for `expired()` a few times a second.
"""
from __future__ import annotations

import threading
import time

# what a stream aborted this way says, should its gateway come back to read it (a process that
# was stopped, not killed)
LEASE_EXPIRED = ("the gateway streaming this request stopped renewing its lease on the replica, which aborted "
                 "the request")


class GatewayLeases:
    def __init__(self, default_lease_s: float = 10.0):
        self.default_lease_s = default_lease_s
        self._lock = threading.Lock()
        self._until: dict[str, float] = {}  # gateway id -> lease deadline (monotonic)
        self._jobs: dict[str, str] = {}  # gateway id -> its process's Ray job id, where it said
        self._streams: dict[str, set[str]] = {}  # gateway id -> request ids it is streaming
        self.expired_gateways = 0
        self.aborted_streams = 0
        self._lapsed: list[tuple[str, str | None]] = []  # (gateway, job) forgotten by `expired`, not yet taken

    def renew(self, gateway: str, lease_s: float, job: str | None = None, now: float | None = None) -> None:
        """`job`: the Ray job id of the gateway's process, by which the replica tells, once the
        lease ran out, whether that process is gone (`take_lapsed`)."""
        now = time.monotonic() if now is None else now
        with self._lock:
            self._until[gateway] = now + lease_s
            if job is not None:
                self._jobs[gateway] = job

    def knows(self, gateway: str) -> bool:
        """Whether `gateway` holds a lease now (it renewed again after its lease ran out)."""
        with self._lock:
            return gateway in self._until

    def open(self, gateway: str | None, request_id: str, now: float | None = None) -> None:
        """A stream for `gateway` starts (no gateway: an in-process caller, never expired)."""
        if gateway is None:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            self._until.setdefault(gateway, now + self.default_lease_s)
            self._streams.setdefault(gateway, set()).add(request_id)

    def close(self, gateway: str | None, request_id: str) -> None:
        if gateway is None:
            return
        with self._lock:
            ids = self._streams.get(gateway)
            if ids is not None:
                ids.discard(request_id)

    def expired(self, now: float | None = None) -> list[str]:
        """Request ids streamed to gateways whose lease ran out; those gateways are forgotten
        (a gateway that comes back renews as new)."""
        now = time.monotonic() if now is None else now
        out: list[str] = []
        with self._lock:
            for gw in [g for g, t in self._until.items() if t <= now]:
                del self._until[gw]
                ids = self._streams.pop(gw, set())
                out.extend(ids)
                self._lapsed.append((gw, self._jobs.pop(gw, None)))
                self.expired_gateways += 1
                self.aborted_streams += len(ids)
        return out

    def take_lapsed(self) -> list[tuple[str, str | None]]:
        """The gateways `expired` has forgotten since the last call, each with its job (None:
        it never said). Their feeds end once their process is gone (the coordinator asks Ray
        about the job; without one, at once)."""
        with self._lock:
            out, self._lapsed = self._lapsed, []
        return out

    def summary(self) -> dict:
        with self._lock:
            return {"gateways": len(self._until), "streams": sum(len(s) for s in self._streams.values()),
                    "expired_gateways": self.expired_gateways, "aborted_streams": self.aborted_streams}
