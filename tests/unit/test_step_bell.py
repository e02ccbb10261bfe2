"""The compiled graph's step doorbell (hyrax/actors/step_bell.py), over real loopback sockets:
the coordinator's wait sleeps until every rank rang, wakes at once when a rank's end closes,
and gives up at its deadline."""
from __future__ import annotations

import threading
import time

import pytest

from hyrax.actors.step_bell import _RING, MAX_RING_RESULT, STOPPED, StepBell, StepRinger


def _bell(ranks: int) -> tuple[StepBell, list[StepRinger]]:
    bell = StepBell("127.0.0.1", ranks)
    ringers = [StepRinger(bell.address, k, bell.key) for k in reversed(range(ranks))]  # any order
    bell.accept(5.0)
    return bell, ringers[::-1]


def _later(seconds: float, fn) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(seconds), fn()))
    t.start()
    return t


def test_wait_sleeps_until_every_rank_rang_then_returns():
    bell, (r0, r1) = _bell(2)
    try:
        r0.ring()
        t = _later(0.15, r1.ring)
        t0, c0 = time.monotonic(), time.thread_time()
        bell.wait(1, time.monotonic() + 10)
        waited, cpu = time.monotonic() - t0, time.thread_time() - c0
        t.join()
        assert bell.rung == [1, 1]
        assert 0.1 < waited < 5
        assert cpu < 0.25 * waited, (cpu, waited)  # asleep in select, not polling
        # later steps count on; a ring ahead (overlap: step 3 rang while step 2 is collected) satisfies it
        r0.ring(), r0.ring(), r1.ring()
        bell.wait(2, time.monotonic() + 5)
        assert min(bell.rung) >= 2 and bell.rung[0] == 3
    finally:
        bell.close()
        r0.close(), r1.close()


def test_a_rank_whose_end_closed_is_not_waited_for():
    bell, (r0, r1) = _bell(2)
    try:
        r0.ring()
        t = _later(0.1, r1.close)  # the rank died (its process' sockets close) or its ring failed
        t0 = time.monotonic()
        bell.wait(1, time.monotonic() + 30)
        t.join()
        assert time.monotonic() - t0 < 5
        assert bell.rung == [1, STOPPED]
    finally:
        bell.close()
        r0.close()


def test_a_rank_whose_end_closed_ends_the_wait_for_the_others_too():
    """A rank that died in a TP step leaves the others stuck in a collective, never ringing:
    the wait returns when the dead rank's end closes, and the dead rank's result is read first."""
    bell, (r0, r1) = _bell(2)
    try:
        t = _later(0.1, r1.close)  # rank 1 died; rank 0 never rings
        t0 = time.monotonic()
        bell.wait(1, time.monotonic() + 30)
        t.join()
        assert time.monotonic() - t0 < 5
        assert bell.rung == [0, STOPPED]
        assert bell.read_order() == [1, 0]
    finally:
        bell.close()
        r0.close()


def test_wait_returns_at_its_deadline_and_after_close():
    bell, (r0,) = _bell(1)
    try:
        t0 = time.monotonic()
        bell.wait(1, t0 + 0.2)
        assert 0.15 < time.monotonic() - t0 < 3
        assert bell.rung == [0]
        bell.close()
        t0 = time.monotonic()
        bell.wait(5, t0 + 30)  # a closed bell (graph torn down) never blocks
        assert time.monotonic() - t0 < 1
        r0.ring()  # the rank's next ring fails quietly and closes its end
        r0.ring()
    finally:
        bell.close()
        r0.close()


def test_a_ring_split_across_reads_is_reassembled():
    """A ring counts once it is whole, its result with it: the wait does not return on a ring
    whose result is still on its way (the collect would find no result and read the graph)."""
    bell, (r0,) = _bell(1)
    try:
        sock = r0._sock
        result = bytes(range(256)) * 3
        frame = _RING.pack(7, len(result)) + result
        for cut in (3, _RING.size, _RING.size + 100):  # inside the header, at its end, inside the result
            sock.sendall(frame[:cut])
            bell.wait(7, time.monotonic() + 0.2)
            assert bell.rung == [0], cut
            sock.sendall(frame[cut:])
            bell.wait(7, time.monotonic() + 5)
            assert bell.rung == [7]
            assert bell.take(7) == [result]
            bell.rung[0] = 0
    finally:
        bell.close()
        r0.close()


def test_rings_carry_step_results_and_take_hands_each_out_once():
    bell, (r0, r1) = _bell(2)
    try:
        assert r0.ring(b"step one, rank 0") is True
        assert r1.ring() is False  # no result (the step raised): the graph carries its error
        bell.wait(1, time.monotonic() + 5)
        assert bell.take(1) == [b"step one, rank 0", None]
        assert bell.take(1) == [None, None]  # handed out once
        # overlap: a rank two steps ahead; taking step 3 forgets what step 2 left untaken
        big = bytes(300_000)  # more than one read of the bell's socket
        assert r0.ring(b"two") and r0.ring(big) and r1.ring(b"r1 two") and r1.ring(b"r1 three")
        bell.wait(3, time.monotonic() + 5)
        assert bell.take(3) == [big, b"r1 three"]
        assert bell.take(2) == [None, None]
    finally:
        bell.close()
        r0.close(), r1.close()


def test_a_result_rung_after_another_ranks_bell_ended_is_still_delivered():
    """Once one rank's bell ended the wait returns at once (the others may be stuck in a
    collective) without reading the others' rings; a rank whose graph output then says its
    result went with its ring gets it read from its connection (`result_of`)."""
    bell, (r0, r1) = _bell(2)
    try:
        r1.close()
        bell.wait(1, time.monotonic() + 5)  # reads rank 1's end
        assert bell.rung[1] == STOPPED
        big = bytes(200_000)  # more than one read of the socket
        assert r0.ring(b"one") and r0.ring(big)
        bell.wait(2, time.monotonic() + 5)  # returns at once: a bell ended
        assert bell.take(2) == [None, None]  # nothing of rank 0's was read
        assert bell.result_of(0, 2, time.monotonic() + 5) == big
        assert bell.result_of(0, 2, time.monotonic() + 0.1) is None  # handed out once
        assert bell.result_of(1, 3, time.monotonic() + 5) is None  # an ended bell has nothing more
    finally:
        bell.close()
        r0.close()


def test_a_ring_with_an_impossible_length_ends_that_ranks_bell():
    bell, (r0, r1) = _bell(2)
    try:
        for n in (-2, MAX_RING_RESULT + 1):
            r0._sock.sendall(_RING.pack(1, n))
            bell.wait(1, time.monotonic() + 5)
            assert bell.rung[0] == STOPPED, n
            bell.close()
            r0.close(), r1.close()
            bell, (r0, r1) = _bell(2)
    finally:
        bell.close()
        r0.close(), r1.close()


def test_a_result_too_large_for_a_ring_goes_through_the_graph():
    bell, (r0,) = _bell(1)
    try:
        assert r0.ring(bytes(MAX_RING_RESULT + 1)) is False
        bell.wait(1, time.monotonic() + 5)
        assert bell.rung == [1] and bell.take(1) == [None]
    finally:
        bell.close()
        r0.close()


def test_a_ring_after_the_bell_closed_says_its_result_did_not_go():
    bell, (r0,) = _bell(1)
    bell.close()
    try:
        deadline = time.monotonic() + 5
        while r0.ring(b"result") and time.monotonic() < deadline:  # the first send may still land in a buffer
            time.sleep(0.01)
        assert r0.ring(b"result") is False
        assert StepRinger.unconnected().ring(b"result") is False
    finally:
        r0.close()


def test_a_bad_rank_index_is_refused():
    bell = StepBell("127.0.0.1", 2)
    ringers = [StepRinger(bell.address, 1, bell.key), StepRinger(bell.address, 1, bell.key)]
    try:
        with pytest.raises(ValueError, match="index 1"):
            bell.accept(5.0)
    finally:
        bell.close()
        for r in ringers:
            r.close()


def test_connections_without_the_key_are_dropped_and_the_ranks_still_join():
    """The bell listens on the node's address: a stranger that connects first (sending nothing,
    a wrong key, or a right index without the key) takes no rank's place."""
    import socket

    bell = StepBell("127.0.0.1", 2)
    strangers = [socket.create_connection(bell.address) for _ in range(3)]
    strangers[1].sendall(b"\0" * 16 + (0).to_bytes(8, "little"))  # index 0, wrong key
    strangers[2].sendall((1).to_bytes(8, "little") + b"x" * 16)  # index first, no key
    strangers[0].close()  # connected, then gone
    ringers = [StepRinger(bell.address, k, bell.key) for k in (1, 0)]
    try:
        bell.accept(10.0)
        for r in ringers:
            r.ring()
        bell.wait(1, time.monotonic() + 5)
        assert bell.rung == [1, 1]
        assert StepBell("127.0.0.1", 1).key != bell.key  # a fresh key per bell
    finally:
        bell.close()
        for s in [*strangers, *ringers]:
            s.close()


def test_accept_gives_up_at_its_deadline_when_only_strangers_came():
    import socket

    bell = StepBell("127.0.0.1", 1)
    stranger = socket.create_connection(bell.address)
    try:
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):
            bell.accept(1.0)
        assert time.monotonic() - t0 < 5
    finally:
        bell.close()
        stranger.close()


def _parked(ringer: StepRinger) -> tuple[threading.Thread, dict]:
    """`ringer.wait_for_wake()` on a thread of its own (as a rank's graph thread runs a park
    step); the dict gets the thread's CPU time and when it returned."""
    got: dict = {}

    def park():
        c = time.thread_time()
        ringer.wait_for_wake()
        got["cpu"], got["at"] = time.thread_time() - c, time.monotonic()

    t = threading.Thread(target=park)
    t.start()
    return t, got


def test_a_parked_rank_sleeps_until_the_bell_wakes_it():
    bell, (r0, r1) = _bell(2)
    try:
        (t0, got0), (t1, got1) = _parked(r0), _parked(r1)
        time.sleep(0.3)
        assert t0.is_alive() and t1.is_alive()  # parked: nothing woke them
        woke = time.monotonic()
        bell.wake()
        t0.join(5), t1.join(5)
        assert not t0.is_alive() and not t1.is_alive()
        assert got0["at"] - woke < 1 and got1["at"] - woke < 1
        assert got0["cpu"] < 0.1 and got1["cpu"] < 0.1, (got0, got1)  # asleep in select, not polling
        # a wake sent before the rank parks is kept for it; each park takes one wake
        bell.wake()
        t0, _ = _parked(r0)
        t0.join(5)
        assert not t0.is_alive()
        t1, _ = _parked(r1)
        t1.join(5)
        assert not t1.is_alive()
        t0, _ = _parked(r0)
        time.sleep(0.2)
        assert t0.is_alive()  # no wake left over for a second park
        bell.wake()
        t0.join(5)
        # the rings that follow the parks still reach the bell
        r0.ring(), r1.ring()
        bell.wait(1, time.monotonic() + 5)
        assert bell.rung == [1, 1]
    finally:
        bell.close()
        r0.close(), r1.close()


def test_closing_the_bell_releases_a_parked_rank():
    """Teardown: the coordinator closes the bell; a parked rank returns (and its next ring finds
    no bell), so the graph's task ends instead of holding the teardown for Ray's 30 s."""
    bell, (r0,) = _bell(1)
    t, got = _parked(r0)
    time.sleep(0.1)
    assert t.is_alive()
    closed = time.monotonic()
    bell.close()
    t.join(5)
    assert not t.is_alive() and got["at"] - closed < 1
    r0.ring()  # never raises
    r0.wait_for_wake()  # no bell: nobody to wait for
    assert StepRinger.unconnected().wait_for_wake() is None
