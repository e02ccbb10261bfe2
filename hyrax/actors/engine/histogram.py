"""A fixed-bucket histogram with constant memory (exported as a Prometheus histogram)."""
from __future__ import annotations

import bisect

DURATION_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...] = DURATION_BUCKETS):
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(buckets) + 1)  # last: +Inf
        self.sum = 0.0
        self.count = 0

    def append(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value
        self.count += 1

    def to_dict(self) -> dict:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": self.count}
