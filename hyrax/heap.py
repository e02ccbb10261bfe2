"""The Python heap of a long-lived serving process: settled once it is built, and its collector's
pauses counted.

Why: a rank, a coordinator or a gateway imports torch, Ray and FastAPI and builds a model: ~220k
objects the cyclic collector tracks before the first request. None of them ever becomes garbage,
yet every full (generation-2) collection walks them all, and CPython starts one on its own once
enough objects have survived the younger collections - on whichever thread allocates at that
moment, which in a replica is the rank's stepping thread or the coordinator's step loop.
Measured on the 2-core bench machine (quick c=16 serving workload, Ray TP=1, before this): one
full collection every ~5 runs, 105-170 ms each, in the rank (a step stalled that long: the
ITL p99) and in the coordinator alike; 20 % of the coordinator loop thread's CPU was the
collector.

`settle()` collects once and then freezes what is left (`gc.freeze`: the objects move to a
permanent generation that collections skip; reference counting still frees them). A frozen
object that later becomes part of an unreachable cycle is never reclaimed, so this runs once a
process has built what it keeps for its life, not per request. vLLM's engine process does the
same after start-up.

`watch()` counts every collection by generation (number, total and longest pause), for
`summary()`: the coordinator reports its own and its ranks' in `health()`.
"""
from __future__ import annotations

import gc
import threading
import time
from dataclasses import dataclass, field


@dataclass
class _Pauses:
    """This process's collections by generation, from the collector's own callbacks."""
    count: list[int] = field(default_factory=lambda: [0, 0, 0])
    total_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    max_s: list[float] = field(default_factory=lambda: [0.0, 0.0, 0.0])
    settle_s: float = 0.0  # settle()'s own full collections, not counted above
    settling: bool = False
    frozen: int = 0  # objects frozen, as of the last settle() (counting them again walks them all)
    began: float | None = None  # when the collection in progress began (they never overlap)

    def on_collect(self, phase: str, info: dict) -> None:
        if phase == "start":
            self.began = time.perf_counter()
            return
        if self.began is None:  # watching began during this collection
            return
        spent, self.began = time.perf_counter() - self.began, None
        if self.settling:
            self.settle_s += spent
            return
        g = info["generation"]
        self.count[g] += 1
        self.total_s[g] += spent
        self.max_s[g] = max(self.max_s[g], spent)


_pauses = _Pauses()
_lock = threading.Lock()


def watch() -> None:
    """Count this process's collections from now on (once per process; repeated calls are no-ops)."""
    with _lock:
        if _pauses.on_collect not in gc.callbacks:
            gc.callbacks.append(_pauses.on_collect)


def settle() -> int:
    """One full collection, then freeze every object still alive: later collections no longer
    walk them. Returns how many objects are frozen in all (this call and earlier ones)."""
    watch()
    _pauses.settling = True
    try:
        gc.collect()
    finally:
        _pauses.settling = False
    gc.freeze()
    _pauses.frozen = gc.get_freeze_count()
    return _pauses.frozen


def summary() -> dict:
    """Objects frozen (as `settle()` counted them); per generation since `watch()`: collections,
    their total and longest pause (ms); and what settling took (ms). O(1): replicas answer it in
    every health check, under the GIL their step loop needs. Counting objects is not: CPython's
    gc.get_freeze_count() walks the frozen generation (22 ms for a coordinator's 216k objects
    on the 2-core bench machine, two decode steps stalled every health check)."""
    p = _pauses
    return {"frozen_objects": p.frozen,
            "collections": list(p.count),
            "pause_ms_total": [round(s * 1e3, 3) for s in p.total_s],
            "pause_ms_max": [round(s * 1e3, 3) for s in p.max_s],
            "settle_ms": round(p.settle_s * 1e3, 3)}
