"""Test-only stand-in for a device's memory query (memory_budget.MemoryQuery).

`UnsafeFaults.stand_in_memory` (refused unless `allow_unsafe`) gives each TP rank a device of
`total` bytes with `used` taken whose profile peaks at `peak` bytes, so `--gpu-memory-fraction`
runs its whole path (profile, budget, the coordinator's agreement over ranks) on CPU ranks.
"""
from __future__ import annotations

from hyrax.actors.engine.config import UnsafeFaults


class StandInMemory:
    def __init__(self, total: int, used: int, peak: int):
        self.total, self.used, self.peak = total, used, peak
        self.calls: list[str] = []  # in order, for tests that check when the device is read

    def free_total(self) -> tuple[int, int]:
        self.calls.append("free_total")
        return self.total - self.used, self.total

    def start_peak(self) -> None:
        self.calls.append("start_peak")

    def peak_since_start(self) -> int:
        self.calls.append("peak_since_start")
        return self.peak


def stand_in_memory(faults: UnsafeFaults, rank: int) -> StandInMemory | None:
    """Rank `rank`'s stand-in device, or None (the device's own query)."""
    if not faults.stand_in_memory:
        return None
    return StandInMemory(*faults.stand_in_memory[rank % len(faults.stand_in_memory)])
