"""A consumer whose event loop closed while it still had streams open (an in-process caller
that closed its loop without finalising its async generators, so no stream was abandoned):
posting its next batch raises in `call_soon_threadsafe`. The loop thread must not die of it
- every other consumer's streams go on - and the closed consumer's requests are aborted, so
nothing stays allocated for streams nobody can read."""
from __future__ import annotations

import asyncio
import threading
import time

from engine_helpers import HYBRID, assert_idle_clean, make_engine, tiny_model
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.step_feed import Sink, is_last


def _wait(cond, timeout: float = 60.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.01)
    return False


def test_a_consumer_whose_event_loop_closed_is_dropped_and_the_loop_serves_on():
    engine = make_engine(tiny_model(HYBRID))
    loop = EngineLoop(engine, "closed-consumer")
    live = asyncio.new_event_loop()
    threading.Thread(target=live.run_forever, daemon=True).start()
    ended: set[str] = set()

    def deliver(batch):
        ended.update(rid for rid, item in batch if is_last(item))
    gone = asyncio.new_event_loop()
    gone.close()  # closed before its first batch: every post to it raises
    params = {"max_tokens": 40, "ignore_eos": True, "temperature": 0.0}
    try:
        loop.submit("orphan", [1, 2, 3, 4], params, Sink(lambda batch: None, gone))
        loop.submit("served", [5, 6, 7], dict(params, max_tokens=12), Sink(deliver, live))
        assert _wait(lambda: "served" in ended), "the other consumer's stream never ended"
        assert loop.thread.is_alive()
        assert _wait(lambda: not engine.has_unfinished() and not engine.has_inflight())
        with loop.lock:
            assert "orphan" not in engine.requests
            assert_idle_clean(engine)
    finally:
        loop.shutdown()
        live.call_soon_threadsafe(live.stop)
