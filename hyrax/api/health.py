"""What a gateway's health round found, in two views.

- `public()`, for `GET /health` (unauthenticated: Kubernetes probes, load balancers): readiness
  and each replica's role, index, state and counts, in the gateway's own words. Nothing a
  replica wrote goes there: its last error holds exception text, addresses and pids.
- `detail()`, for `GET /admin/health` (admin token): the same, with each replica's own health
  answer (its last error, its stuck reason, its device and memory) and reasons that quote them.

The gateway judges each replica once per round (`judge`); `EngineClient.health` builds the
report from the answers and its routing bookkeeping.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class ReplicaState(str, Enum):
    HEALTHY = "healthy"
    STUCK = "stuck"  # answers, but reports no progress with work waiting, or a violated pool invariant
    RESTARTING = "restarting"  # replacing its ranks after a rank failure
    UNHEALTHY = "unhealthy"  # answers unhealthy otherwise (it gave up, or the gateway cannot reach it)
    DOWN = "down"  # its rank restarts are used up: out until the controller replaces it
    UNRESPONSIVE = "unresponsive"  # did not answer this round's check within the health timeout


def judge(answer: dict) -> ReplicaState:
    """The state a replica's health answer says it is in (`healthy` None: no answer in time)."""
    if answer.get("healthy") is None:
        return ReplicaState.UNRESPONSIVE
    if answer.get("down"):
        return ReplicaState.DOWN
    if not answer.get("healthy"):
        return ReplicaState.RESTARTING if answer.get("restarting") else ReplicaState.UNHEALTHY
    if answer.get("stuck"):
        return ReplicaState.STUCK
    return ReplicaState.HEALTHY


@dataclass(frozen=True)
class ReplicaHealth:
    role: str
    replica: int
    state: ReplicaState
    in_service: bool  # the gateway routes new requests to it
    draining: bool  # an operator's drain: in service for requests already streaming only
    missed_checks: int  # health checks unanswered in a row
    why_out: str | None  # the gateway's own words for why it is out of service (no replica text)
    answer: dict  # the replica's own health answer (operator only: holds its last error)

    @property
    def name(self) -> str:
        return f"{self.role}/{self.replica}"

    def public(self) -> dict:
        return {"role": self.role, "replica": self.replica, "state": self.state.value, "in_service": self.in_service,
                "draining": self.draining, "restarts": int(self.answer.get("restarts") or 0),
                "missed_checks": self.missed_checks}

    def public_reason(self) -> str:
        return f"{self.name}: {self.why_out or self.state.value}"

    def detail_reason(self) -> str:
        """Why it is out of service, quoting the replica: its stuck reason, or its state with the
        first line of its last error."""
        if self.why_out is not None or self.state == ReplicaState.UNRESPONSIVE:
            return self.public_reason()
        if self.state == ReplicaState.STUCK:
            return f"{self.name}: {self.answer['stuck']}"
        first = (self.answer.get("last_error") or "").strip().splitlines()
        return f"{self.public_reason()} ({first[0]})" if first else self.public_reason()


@dataclass(frozen=True)
class HealthReport:
    replicas: tuple[ReplicaHealth, ...]
    unavailable: str | None  # why no request could be served end to end now (gateway's words); None: ready

    @property
    def ready(self) -> bool:
        return self.unavailable is None

    def _reasons(self, reason) -> list[str]:
        out = [reason(r) for r in self.replicas if not r.in_service]
        return out + ([self.unavailable] if self.unavailable else [])

    @property
    def public_reasons(self) -> list[str]:
        """Every replica out of service with its state, then why the gateway is not ready."""
        return self._reasons(ReplicaHealth.public_reason)

    def public(self) -> dict:
        return {"ready": self.ready, "replicas": [r.public() for r in self.replicas], "reasons": self.public_reasons}

    def detail(self) -> dict:
        return {"ready": self.ready, "replicas": [{**r.public(), "health": r.answer} for r in self.replicas],
                "reasons": self._reasons(ReplicaHealth.detail_reason)}


NOT_CHECKED = HealthReport((), "no health check has run yet")  # a gateway before its first round
