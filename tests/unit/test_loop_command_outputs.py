"""An operator's retract or resume first commits the step in flight (`Engine.sync`). When that
step was a request's last, the request finished inside the command, and its last tokens and
its end waited in the engine for the next step's outputs; with nothing else to run there was
no next step: the client's stream stalled for ever, one token short, while the request was gone
from every listing (found by a chaos run against `hyrax serve` with concurrent admin commands).
Every turn of the loop now delivers what it committed."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine_helpers import HYBRID, assert_idle_clean, make_engine, tiny_model
from hyrax.actors.engine.commands import Resume, Retract
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.selection import Selection
from hyrax.actors.engine.step_feed import Sink, is_last

MAX_TOKENS = 6


@pytest.mark.parametrize("command", ["retract", "resume"])
def test_a_request_that_finishes_inside_an_admin_command_still_ends_its_stream(command):
    engine = make_engine(tiny_model(HYBRID), overlap=True)
    loop = EngineLoop(engine, "command-outputs")
    rid = "last-step-in-flight"
    at_last, go_on = threading.Event(), threading.Event()
    inner = loop.lock.let_waiters_in

    def between_steps(*a, **kw):  # the loop thread, lock released, after each step's turn
        req = engine.requests.get(rid)
        if req is not None and engine.has_inflight() and len(req.output_ids) == MAX_TOKENS - 1:
            at_last.set()  # the step in flight is the request's last: hold the loop here
            assert go_on.wait(30)
        return inner(*a, **kw)
    loop.lock.let_waiters_in = between_steps
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    got: list[dict] = []

    def deliver(batch):
        got.extend(item for r, item in batch if r == rid)
    try:
        loop.submit(rid, [1, 2, 3, 4, 5, 6, 7], {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0},
                    Sink(deliver, aloop))
        assert at_last.wait(30), "the request never reached its last step"
        sel = Selection(ids=(rid,))
        loop.run(Retract(sel) if command == "retract" else Resume(sel))  # commits the step in flight
        go_on.set()
        deadline = time.monotonic() + 10
        while not (got and is_last(got[-1])) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got and is_last(got[-1]), f"the stream never ended; it got {got}"
        assert got[-1]["finish_reason"] == "length"
        assert sum(len(i["token_ids"]) for i in got) == MAX_TOKENS
    finally:
        go_on.set()
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    assert_idle_clean(engine)
