"""Which replicas the deployment controller must replace: bookkeeping over health checks, no Ray.

Every round the controller asks each replica's coordinator for its health and waits at most
`health_timeout_s` for all of them together. A replica that answered is alive. One whose actor Ray
reports dead is lost at once. One that stays silent (its process frozen, a deadlock, a machine
swapping) is alive to Ray, and only this check can tell: once it has gone `hung_after_s` without
an answer it is judged hung, and the controller kills and replaces it like a dead one (its
gateways then rebuild its requests elsewhere, as for a replica lost with its node). One that
answers that it is down (its ranks failed again after all the restarts it makes itself) is
replaced too: alive, it would serve nothing for ever.

Replacing a replica can fail (no room, or ranks that cannot start: too little memory, a bad
device); the next attempt for that role then waits twice as long as the last, up to
`retry_max_s`, so a deployment that cannot be made whole does not load a model every round.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from hyrax.actors.model.errors import HyraxInputError


@dataclass(frozen=True)
class Supervision:
    interval_s: float = 2.0  # between rounds of health checks
    health_timeout_s: float = 5.0  # a round waits this long for every answer
    hung_after_s: float = 15.0  # no answer for this long: hung, replaced
    retry_max_s: float = 60.0  # the longest wait between two failed attempts to replace a replica

    def __post_init__(self):
        if not 0 < self.health_timeout_s <= self.hung_after_s or self.interval_s <= 0:
            raise HyraxInputError(f"--hung-replica-timeout {self.hung_after_s:g}: must be at least the health "
                                  f"check's timeout ({self.health_timeout_s:g} s)")


class Check(enum.Enum):
    ANSWERED = "answered"  # healthy or not, it answered: its own health is the gateways' business
    DIED = "died"  # Ray says the actor is gone
    SILENT = "silent"  # no answer within the round's timeout
    DOWN = "down"  # it answered that it gave up: its ranks cannot be restarted


class Verdict(enum.Enum):
    ALIVE = "alive"
    SILENT = "silent"  # not answering yet, not for long enough to be called hung
    DEAD = "dead"
    HUNG = "hung"
    DOWN = "down"


class HealthTracker:
    def __init__(self, policy: Supervision):
        self.policy = policy
        self.last_answer: dict[object, float] = {}  # replica key -> when it last answered (monotonic)

    def judge(self, key, check: Check, now: float) -> Verdict:
        if check in (Check.DIED, Check.DOWN):
            self.last_answer.pop(key, None)
            return Verdict.DEAD if check is Check.DIED else Verdict.DOWN
        if check is Check.ANSWERED:
            self.last_answer[key] = now
            return Verdict.ALIVE
        # silent in its first round: it has been silent for that round's timeout at least
        since = self.last_answer.setdefault(key, now - self.policy.health_timeout_s)
        if now - since >= self.policy.hung_after_s:
            self.last_answer.pop(key, None)
            return Verdict.HUNG
        return Verdict.SILENT


class ReplaceBackoff:
    """When the controller may next try to place a replica of each role: at once, then after
    every failed attempt twice the last wait (from the check interval up to `retry_max_s`);
    a success resets the role."""

    def __init__(self, policy: Supervision):
        self.policy = policy
        self.failures: dict[str, int] = {}
        self.not_before: dict[str, float] = {}

    def due(self, role: str, now: float) -> bool:
        return now >= self.not_before.get(role, float("-inf"))

    def failed(self, role: str, now: float) -> float:
        """Count a failed attempt; returns the wait before the next one."""
        n = self.failures[role] = self.failures.get(role, 0) + 1
        wait = min(self.policy.interval_s * 2 ** (n - 1), self.policy.retry_max_s)
        self.not_before[role] = now + wait
        return wait

    def succeeded(self, role: str) -> None:
        self.failures.pop(role, None)
        self.not_before.pop(role, None)
