"""Opening a stream never waits for the step in flight: the caller (over Ray, the replica's
event loop, which also streams every other request's tokens and takes the next submissions)
queues the stream, and the loop thread admits it before its next step. A step in flight holds
the loop's lock for the whole step; before, each submission waited for that lock."""
from __future__ import annotations

import asyncio
import threading
import time

import torch

from engine_helpers import HYBRID, assert_idle_clean, make_engine, reference_outputs, tiny_model
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.step_feed import Sink, is_last

PROMPTS = [[1, 2, 3, 4, 5], [6, 7, 8], [9, 10, 11, 12]]


def _gate_steps(engine, gate: threading.Event, entered: threading.Event) -> None:
    """Hold every step's rank work until `gate` is set (the rank is the real one)."""
    rank = engine.executor.rank
    inner = rank.execute

    def execute(plan):
        entered.set()
        assert gate.wait(60), "the test never released the step"
        return inner(plan)
    rank.execute = execute


def test_submissions_return_while_a_step_is_in_flight_and_then_run_exactly():
    engine = make_engine(tiny_model(HYBRID))
    loop = EngineLoop(engine, "admission")
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    items: dict[str, list[int]] = {}
    ended: set[str] = set()

    def deliver(batch):
        for rid, item in batch:
            items.setdefault(rid, []).extend(item.get("token_ids") or [])
            if is_last(item):
                ended.add(rid)
    sink = Sink(deliver, aloop)
    gate, entered = threading.Event(), threading.Event()
    _gate_steps(engine, gate, entered)
    params = {"max_tokens": 6, "ignore_eos": True, "temperature": 0.0}
    try:
        loop.submit("first", PROMPTS[0], params, sink)
        assert entered.wait(60)  # the loop thread is inside a step, holding the lock
        done = threading.Event()

        def submit_more():
            for k, p in enumerate(PROMPTS[1:], start=1):
                loop.submit(f"r{k}", p, params, sink)
            done.set()
        threading.Thread(target=submit_more, daemon=True).start()
        assert done.wait(10), "a submission waited for the step in flight"
        assert loop.load() >= 3  # queued streams count for the router
        gate.set()
        deadline = time.monotonic() + 120
        while not {"first", "r1", "r2"} <= ended and time.monotonic() < deadline:
            time.sleep(0.02)
        assert {"first", "r1", "r2"} <= ended
        want = reference_outputs(HYBRID, torch.float32, PROMPTS, max_tokens=6)
        assert [items["first"], items["r1"], items["r2"]] == want
    finally:
        gate.set()
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    assert_idle_clean(engine)
