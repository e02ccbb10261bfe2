"""The engine loop's lock lets a waiting caller in between two steps: the loop thread holds it
for a whole step and takes it again at once, which a plain lock does not hand over (under load
the admin API waited through a whole run of 32 streams: test_retraction_under_load)."""
from __future__ import annotations

import threading
import time

from hyrax.actors.engine.loop import TurnLock


def _steps_before_a_waiter_gets_in(lock, yield_turn) -> int:
    got = threading.Event()
    steps = 0
    started = threading.Event()

    def caller():
        started.set()
        with lock:
            got.set()

    t = None
    while not got.is_set() and steps < 200:
        with lock:
            if t is None:
                t = threading.Thread(target=caller)
                t.start()
                started.wait()
            time.sleep(0.005)  # a step's work, holding the lock
        steps += 1
        yield_turn()
    t.join(5)
    return steps


def test_a_waiting_caller_gets_the_lock_at_the_next_step_boundary():
    lock = TurnLock()
    assert _steps_before_a_waiter_gets_in(lock, lock.let_waiters_in) <= 2


def test_reentrant_and_counts_nothing_when_idle():
    lock = TurnLock()
    with lock:
        with lock:
            pass
    assert lock._waiting == 0
    lock.let_waiters_in()  # returns at once
