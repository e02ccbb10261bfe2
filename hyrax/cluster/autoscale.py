"""When to add or remove a replica of the scaling role: plain data and arithmetic, no Ray.

The deployment controller measures each serving replica of the role once per interval (requests
waiting for admission, requests held, the fullest device pool) and asks `Autoscaler.decide`.
Hysteresis keeps a burst or a lull from flapping the deployment: a scale-up needs `up_after`
overloaded measurements in a row, a scale-down `down_after` quiet ones in a row, and any change
resets both streaks.
"""
from __future__ import annotations

from dataclasses import dataclass

from hyrax.actors.model.errors import HyraxInputError


@dataclass(frozen=True)
class ScalePolicy:
    min_replicas: int
    max_replicas: int
    up_waiting_per_replica: float = 1.0  # waiting requests per replica above which it is overloaded
    up_pool_usage: float = 0.85  # or a device pool this full on any replica
    down_load_per_replica: float = 2.0  # all requests would fit one replica fewer at this load
    up_after: int = 3
    down_after: int = 10
    # requests held per replica above which it is overloaded (None: not a signal). A prefill
    # replica admits prompts at once and hands each off after its first token, so its queue is
    # the prompts it is prefilling, not requests waiting for admission
    up_held_per_replica: float | None = None

    def __post_init__(self):
        if not 1 <= self.min_replicas <= self.max_replicas:
            raise HyraxInputError(f"--min-replicas {self.min_replicas} and --max-replicas {self.max_replicas}: "
                                  f"need 1 <= min <= max")


@dataclass(frozen=True)
class ReplicaLoad:
    waiting: int  # queued for admission (not running yet)
    held: int  # every request the replica holds: running, waiting, retracted, in hand-off
    pool_usage: float  # the fullest device pool, used / capacity


class Autoscaler:
    def __init__(self, policy: ScalePolicy):
        self.policy = policy
        self.up_streak = 0
        self.down_streak = 0

    def decide(self, loads: list[ReplicaLoad]) -> int:
        """+1 (add a replica), -1 (retire one) or 0, for the serving replicas' `loads`."""
        p, n = self.policy, len(loads)
        if n < p.min_replicas:
            return self._changed(+1)
        if n > p.max_replicas:
            return self._changed(-1)
        waiting = sum(x.waiting for x in loads)
        held = sum(x.held for x in loads)
        overloaded = (waiting > p.up_waiting_per_replica * n or any(x.pool_usage >= p.up_pool_usage for x in loads)
                      or (p.up_held_per_replica is not None and held > p.up_held_per_replica * n))
        quiet = (not waiting and n > 1
                 and held <= p.down_load_per_replica * (n - 1)
                 and all(x.pool_usage < p.up_pool_usage / 2 for x in loads))
        self.up_streak = self.up_streak + 1 if overloaded else 0
        self.down_streak = self.down_streak + 1 if quiet else 0
        if self.up_streak >= p.up_after and n < p.max_replicas:
            return self._changed(+1)
        if self.down_streak >= p.down_after and n > p.min_replicas:
            return self._changed(-1)
        return 0

    def _changed(self, step: int) -> int:
        self.up_streak = self.down_streak = 0
        return step
