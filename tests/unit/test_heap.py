"""hyrax/heap.py in a fresh interpreter (freezing changes the whole process's heap, so not
pytest's own): what was alive at `settle()` is frozen and no longer walked by a full collection,
cycles made afterwards are still collected, and the collections are counted by generation."""
from __future__ import annotations

import json
import subprocess
import sys

SCRIPT = r"""
import gc, json
from hyrax import heap

kept = [[i] for i in range(100_000)]  # a long-lived heap (lists: always tracked), as a model's objects are
frozen = heap.settle()
walked_after_settle = len(gc.get_objects())

class Cycle:
    pass

import weakref
refs = []
for _ in range(1000):                               # garbage made after settling, in cycles
    a, b = Cycle(), Cycle()
    a.other, b.other = b, a
    refs.append(weakref.ref(a))
del a, b
gc.collect()
print(json.dumps({"frozen": frozen, "walked": walked_after_settle,
                  "cycles_left": sum(r() is not None for r in refs), "summary": heap.summary(),
                  "kept": len(kept)}))
"""


def test_settle_freezes_the_heap_and_later_cycles_are_still_collected():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, check=True)
    r = json.loads(out.stdout)
    assert r["frozen"] >= 100_000  # every object alive at settle(), the 100k lists included
    assert r["walked"] < 1_000  # what a full collection still walks right after settling
    assert r["cycles_left"] == 0  # the collector still works for everything made afterwards
    s = r["summary"]
    assert s["collections"][2] >= 1  # the explicit full collection after settling, counted
    assert s["settle_ms"] > 0 and s["pause_ms_total"][2] >= s["pause_ms_max"][2] > 0
    assert s["frozen_objects"] == r["frozen"] and "tracked_objects" not in s  # summary() stays O(1)


SUMMARY_WITHOUT_WALK = r"""
import gc, json
from hyrax import heap

kept = [[i] for i in range(1000)]
frozen = heap.settle()
def walk():  # CPython counts the permanent generation by walking it: ~22 ms for a replica's 216k objects
    raise AssertionError("summary() walked the frozen generation")
gc.get_freeze_count = walk
print(json.dumps({"frozen": frozen, "summary": heap.summary()}))
"""


def test_summary_does_not_walk_the_frozen_heap():
    """The coordinator answers `summary()` in every health check (each gateway asks every 2 s),
    on a thread whose GIL the step loop needs: it reports the count `settle()` found instead
    of counting the frozen generation again (a list walk in CPython, 22 ms in a replica)."""
    out = subprocess.run([sys.executable, "-c", SUMMARY_WITHOUT_WALK], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    r = json.loads(out.stdout)
    assert r["summary"]["frozen_objects"] == r["frozen"] >= 1000
