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


def test_idle_pool_check_waits_for_a_quiet_replica_and_never_delays_the_next_request():
    """The pool invariants are checked when the replica has stayed idle for a while, not the
    moment its last request ends: the check walks every pool under the loop's lock, and a
    closed-loop client's next request (arriving milliseconds later) waited for it."""
    engine = make_engine(tiny_model(HYBRID))
    calls: list[float] = []
    inner = engine.check_invariants

    def check():
        calls.append(time.monotonic())
        inner()
    engine.check_invariants = check
    loop = EngineLoop(engine, "idle-check")
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    ends: dict[str, float] = {}

    def deliver(batch):
        for rid, item in batch:
            if is_last(item):
                ends[rid] = time.monotonic()
    sink = Sink(deliver, aloop)
    params = {"max_tokens": 3, "ignore_eos": True, "temperature": 0.0}

    def run(rid: str, prompt: list[int]) -> float:
        loop.submit(rid, prompt, params, sink)
        deadline = time.monotonic() + 60
        while rid not in ends and time.monotonic() < deadline:
            time.sleep(0.002)
        assert rid in ends
        return ends[rid]
    try:
        time.sleep(loop.idle_check_after_s + 0.2)  # the start-up idle period is checked
        assert len(calls) == 1
        end_a = run("a", PROMPTS[0])
        time.sleep(0.05)  # the next request arrives while the replica is idle, before the check is due
        end_b = run("b", PROMPTS[1])
        time.sleep(loop.idle_check_after_s + 0.3)
    finally:
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    after_a = [t for t in calls if end_a <= t < end_b]
    assert not after_a, f"the pools were checked {1e3 * (after_a[0] - end_a):.0f} ms after a request ended"
    later = [t - end_b for t in calls if t >= end_b]
    assert len(later) == 1 and later[0] >= loop.idle_check_after_s - 0.06, later  # then checked once, quietly
    assert loop.invariant_error is None
    assert_idle_clean(engine)


def test_a_stream_opened_on_a_loop_that_has_stopped_is_refused_at_once_with_503():
    """A replica whose loop has stopped (shutdown, retirement) answered a stream queued while
    it stopped with a 400-status error, and one opened after it stopped never at all: its
    stream waited for a thread that was gone. Both are refused at once, as a 503 (retry
    elsewhere), and nothing is admitted."""
    engine = make_engine(tiny_model(HYBRID))
    loop = EngineLoop(engine, "stopped")
    loop.shutdown()
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    got: list[dict] = []
    answered = threading.Event()

    def deliver(batch):
        got.extend(item for _, item in batch)
        answered.set()
    loop.submit("late", PROMPTS[0], {"max_tokens": 4}, Sink(deliver, aloop))
    assert answered.wait(10), "a stream opened after the loop stopped was never answered"
    assert got[0]["finish_reason"] == "error" and got[0]["status"] == 503, got
    assert "shutting down" in got[0]["error"]
    assert not engine.has_unfinished()
    assert_idle_clean(engine)
    aloop.call_soon_threadsafe(aloop.stop)


def test_an_abort_with_a_reason_ends_the_stream_saying_why():
    """A replica aborting a request its gateway stopped renewing ended the stream with a bare
    "abort"; a gateway that was only stalled (SIGSTOP) then told its client nothing. The reason
    travels as the last item's error (503), the finish reason stays "abort"; a plain abort
    (the client left, an operator) carries none."""
    engine = make_engine(tiny_model(HYBRID))
    loop = EngineLoop(engine, "reasons")
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    last: dict[str, dict] = {}
    running = threading.Event()

    def deliver(batch):
        for rid, item in batch:
            if item.get("token_ids"):
                running.set()
            if is_last(item):
                last[rid] = item
    sink = Sink(deliver, aloop)
    params = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0.0}
    try:
        loop.submit("why", PROMPTS[0], params, sink)
        loop.submit("plain", PROMPTS[1], params, sink)
        assert running.wait(60)
        assert loop.abort("why", reason="the gateway went quiet")
        assert loop.abort("plain")
        deadline = time.monotonic() + 10
        while len(last) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    assert last["why"]["finish_reason"] == "abort"
    assert (last["why"]["error"], last["why"]["status"]) == ("the gateway went quiet", 503)
    assert last["plain"]["finish_reason"] == "abort" and "error" not in last["plain"]
    assert_idle_clean(engine)


def test_a_request_whose_admission_raises_an_unexpected_error_ends_and_the_loop_serves_on():
    """Admission runs in the loop thread, outside the guard around steps: a start whose checks
    raised anything but HyraxInputError (here a TypeError: `temperature` None reached
    `math.isfinite`; a coordinator's `submit` takes its params from any Ray caller) ended the
    loop thread. Its stream never ended, and neither did any other: the replica still said it
    was healthy and never stepped again."""
    engine = make_engine(tiny_model(HYBRID))
    loop = EngineLoop(engine, "admission-error")
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    last: dict[str, dict] = {}
    sink = Sink(lambda batch: last.update((rid, item) for rid, item in batch if is_last(item)), aloop)
    try:
        loop.submit("bad", [1, 2, 3], {"max_tokens": 3, "temperature": None}, sink)
        loop.submit("good", [1, 2, 3], {"max_tokens": 3, "ignore_eos": True}, sink)
        deadline = time.monotonic() + 10
        while len(last) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert loop.thread.is_alive(), "the loop thread ended"
        assert last.get("bad", {}).get("finish_reason") == "error" and last["bad"]["error"], last
        assert last.get("good", {}).get("finish_reason") == "length", last
    finally:
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    assert not engine.has_unfinished()
    assert_idle_clean(engine)


def test_an_import_that_raised_after_it_entered_the_table_leaves_nothing_behind():
    """The same for an import that failed halfway (the request table had taken it): it must not
    stay, to run for nobody and hold its units."""
    from engine_helpers import greedy

    source, engine = make_engine(tiny_model(HYBRID)), make_engine(tiny_model(HYBRID))
    source.add_request([1, 2, 3, 4, 5], greedy(max_tokens=20, ignore_eos=True), "moved")
    while len(source.requests["moved"].output_ids) < 2:
        source.step()
    handoff = dict(source.export_running("moved"), source=None)

    def load(req):
        raise RuntimeError("a bug while loading the import")
    engine.transfers.load = load
    loop = EngineLoop(engine, "import-error")
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    last: list[dict] = []
    try:
        loop.submit_imported(handoff, Sink(lambda batch: last.extend(i for _, i in batch if is_last(i)), aloop))
        deadline = time.monotonic() + 10
        while not last and time.monotonic() < deadline:
            time.sleep(0.01)
        assert last and last[0]["finish_reason"] == "error", last
        assert loop.thread.is_alive() and not engine.has_unfinished()
    finally:
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    source.abort("moved")
    assert_idle_clean(engine)
    assert_idle_clean(source)
