"""A doorbell each rank rings when a compiled-graph step ends, so that the coordinator waits for
the step's result blocked in the kernel instead of spinning in Ray's channel read.

Why: Ray 2.60 reads a compiled graph's output channel by polling the channel's version in a
loop around `sched_yield` (`PlasmaObjectHeader::ReadAcquire`; Ray has no blocking mode nor a
setting for it). A coordinator waiting for a 20 ms step used 20 ms of CPU; on the 2-core box,
while the rank's forward ran, ~8 of 16 ms — CPU the forward needed. With the bell the
coordinator sleeps in `select` until every rank has rung, then reads the channels (the rank
rings just before Ray writes its result, so the read finds it or waits microseconds).

How: the coordinator listens on its node's address (as the TP group's store does; ranks may sit
on other nodes); each rank connects once (`StepRinger`), sends the bell's key (16 random bytes
the coordinator handed it through Ray: a connection without it is dropped, whoever made it)
and its index, then one ring after every graph step, whether the step returned or raised: how
many steps it has run in this graph (graph steps run in the order they were sent, so the
coordinator waits for ring N to collect its N-th step), and the step's result when it returned
one. A rank that died, or whose ring failed, ends its stream: from then on the coordinator no
longer waits for that rank's bell and Ray's read decides (its result, its error, or the timeout).

The result rides with the ring because Ray writes a step's output only after the rank's method
has returned: a coordinator woken by a bare ring then spun 0.14-0.17 ms in Ray's channel read
per step (measured, Ray TP=1, batch 32) before it could commit, on the critical path of every
step without overlap and on the core the gateway shares. A rank whose result came with its ring
answers the graph with `WITH_RING`, which the coordinator reads later (step_graph.py: Ray needs
every output read, in order) once Ray has long written it. A step that raised rings without a
result: its error travels through the graph as before.

The bell also rests an idle replica's ranks. Ray's side of a compiled graph waits for the next
plan the same way, polling, so a rank with no step to run kept a whole core busy (measured:
~100 % of a core per idle rank, against ~2 % with plain actor calls). When the replica goes
idle the coordinator sends one step that parks every rank (`step_graph.PARK`): the rank blocks
in `StepRinger.wait_for_wake`, asleep in the kernel on its bell connection, until the coordinator
sends a wake byte (`StepBell.wake`) before its next step, or closes the bell. The park step then
ends and is collected like any other, ~0.3 ms once per idle period.
"""
from __future__ import annotations

import hmac
import logging
import select
import secrets
import selectors
import socket
import struct
import sys
import time

_STEP = struct.Struct("<q")  # a rank's index, after the key, when it connects
# a ring: how many steps the rank ran in this graph, and the byte length of the step's result that
# follows (NO_RESULT: none, read the graph's output)
_RING = struct.Struct("<qq")
NO_RESULT = -1
MAX_RING_RESULT = 1 << 20  # a larger result goes through the graph
RING_TIMEOUT_S = 30.0  # a ring the coordinator's end does not take in this time ends the rank's bell
STOPPED = sys.maxsize  # a rank whose bell ended counts as having rung for every step
KEY_BYTES = 16
WAKE = b"w"  # what the coordinator sends a parked rank

log = logging.getLogger(__name__)


def _family(ip: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in ip else socket.AF_INET


class StepBell:
    """The coordinator's end: one listening socket, one connection per rank."""

    def __init__(self, host: str, ranks: int):
        self.ranks = ranks
        self.key = secrets.token_bytes(KEY_BYTES)  # what a rank's connection must send first
        # room in the listen queue beyond the ranks: they connect before `accept` runs, and a few
        # strangers queued first must not keep them out
        self._server = socket.create_server((host, 0), family=_family(host), backlog=ranks + 16)
        self.address: tuple[str, int] = (host, self._server.getsockname()[1])
        self._selector = selectors.DefaultSelector()
        self._open: dict[int, socket.socket] = {}  # rank -> its connection, while its bell lasts
        self._pending: dict[int, bytearray] = {}  # rank -> bytes of a ring not yet complete
        self._results: list[dict[int, bytes]] = [{} for _ in range(ranks)]  # per rank: step -> result
        self.rung = [0] * ranks  # per rank: how many steps it rang for (STOPPED: its bell ended)

    def accept(self, timeout_s: float) -> None:
        """Take every rank's connection (each sends the key, then its index). A connection that
        does not send the key at once is dropped. Raises TimeoutError when a rank did not connect
        in time, ValueError when one sent a bad index."""
        deadline = time.monotonic() + timeout_s
        seen: set[int] = set()
        while len(seen) < self.ranks:
            self._server.settimeout(max(deadline - time.monotonic(), 0.001))
            conn, peer = self._server.accept()
            conn.settimeout(max(min(deadline - time.monotonic(), 2.0), 0.001))
            try:
                hello = _recv_exact(conn, KEY_BYTES + _STEP.size)
            except OSError:  # ConnectionError, a timeout: not a rank
                hello = b""
            if not hmac.compare_digest(hello[:KEY_BYTES], self.key) or len(hello) != KEY_BYTES + _STEP.size:
                log.warning("step bell: dropped a connection from %s without the bell's key", peer)
                conn.close()
                continue
            index = _STEP.unpack(hello[KEY_BYTES:])[0]
            if not 0 <= index < self.ranks or index in seen:
                conn.close()
                raise ValueError(f"step bell: rank index {index} is not one of {self.ranks} ranks or came twice")
            seen.add(index)
            conn.setblocking(False)
            self._open[index] = conn
            self._selector.register(conn, selectors.EVENT_READ, index)
        self._server.close()

    def wait(self, step: int, deadline: float) -> None:
        """Block until every rank rang for its `step`-th step (counting from 1) or a later one,
        or until any rank's bell ended, or until `deadline` (time.monotonic()); the caller then
        reads the results from the graph, the ranks whose bell ended first (`read_order`). A
        rank whose bell ended has most likely died, and a rank that died in a TP step leaves the
        others waiting in a collective: waiting for their rings would only reach the deadline."""
        while min(self.rung) < step and STOPPED not in self.rung:
            left = deadline - time.monotonic()
            if left <= 0:
                return
            for key, _ in self._selector.select(left):
                self._drain(key.fileobj, key.data)

    def _drain(self, conn: socket.socket, rank: int) -> None:
        try:
            data = conn.recv(1 << 16)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:  # the rank's end closed: it died or its ring failed
            self._end(conn, rank)
            return
        buf = self._pending.setdefault(rank, bytearray())
        buf += data
        at = 0
        while len(buf) - at >= _RING.size:
            steps, n = _RING.unpack_from(buf, at)
            if not NO_RESULT <= n <= MAX_RING_RESULT:  # no ringer sends that: the stream is not a bell's
                log.warning("step bell: rank %d sent a ring of %d result bytes; its bell ends", rank, n)
                self._end(conn, rank)
                return
            end = at + _RING.size + max(n, 0)
            if end > len(buf):
                break  # the rest of this ring's result is still on its way
            if n != NO_RESULT:
                self._results[rank][steps] = bytes(buf[at + _RING.size:end])
            self.rung[rank] = max(self.rung[rank], steps)
            at = end
        del buf[:at]

    def _end(self, conn: socket.socket, rank: int) -> None:
        self._open.pop(rank, None)
        self._selector.unregister(conn)
        conn.close()
        self.rung[rank] = STOPPED
        self._pending.pop(rank, None)  # a ring cut short is no ring

    def result_of(self, rank: int, step: int, deadline: float) -> bytes | None:
        """The result `rank`'s ring for `step` carried, reading its connection until that ring is
        whole (the rank sent it in full before its step returned, so it is here or on its way),
        its bell ends, or `deadline`. For a rank whose graph output said `WITH_RING` after `wait`
        returned early, when another rank's bell had ended: its ring was not read yet."""
        conn = self._open.get(rank)
        while step not in self._results[rank] and conn is not None and self.rung[rank] != STOPPED:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([conn], [], [], left)[0]:
                break
            self._drain(conn, rank)
        return self._results[rank].pop(step, None)

    def take(self, step: int) -> list[bytes | None]:
        """Per rank, the result its ring for `step` carried (None: it carried none, or the rank's
        bell ended before it); forgets that step's results and any earlier ones."""
        out = []
        for got in self._results:
            out.append(got.pop(step, None))
            for old in [s for s in got if s < step]:
                del got[old]
        return out

    def read_order(self) -> list[int]:
        """Rank indices, those whose bell ended first: their results (most likely a dead
        actor's error) are read before any rank that may be stuck waiting for them."""
        return sorted(range(self.ranks), key=lambda k: self.rung[k] != STOPPED)

    def wake(self) -> None:
        """Wake every rank parked on this bell (one byte each). A connection that cannot take it
        is the end of that rank's bell: its park step's result, or its error, tells the rest."""
        for conn in self._open.values():  # an ended bell's connection is closed already
            try:
                conn.send(WAKE)
            except OSError as e:  # BlockingIOError too: a rank that stopped reading is not parked
                log.warning("step bell: could not wake a rank (%s)", e)

    def close(self) -> None:
        """Close every connection; a `wait` after this returns at once."""
        self._server.close()
        for conn in self._open.values():  # an ended bell's connection is closed already
            conn.close()
        self._open = {}
        self._selector.close()
        self.rung = [STOPPED] * self.ranks


class StepRinger:
    """A rank's end: connects at once; `ring` never raises (a failed ring closes the
    connection, which the coordinator sees as the end of this rank's bell)."""

    def __init__(self, address: tuple[str, int], index: int, key: bytes, timeout_s: float = 10.0):
        self._sock: socket.socket | None = socket.create_connection(address, timeout=timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(bytes(key) + _STEP.pack(index))
        # a ring carries a result of up to MAX_RING_RESULT bytes; one the coordinator does not take
        # in time (it stopped reading: only a dead or wedged coordinator does) ends this bell
        self._sock.settimeout(RING_TIMEOUT_S)
        self.steps = 0

    @classmethod
    def unconnected(cls) -> StepRinger:
        """A ringer with no bell (a rank outside any graph): `ring` does nothing."""
        ringer = cls.__new__(cls)
        ringer._sock, ringer.steps = None, 0
        return ringer

    def ring(self, result: bytes | None = None) -> bool:
        """One more step has ended; `result`: its result, for the coordinator to take from the
        ring (StepBell.take). True when the result went with the ring; False when there was none
        to send (no bell, or one larger than MAX_RING_RESULT) or the ring failed: the graph's
        output must carry it."""
        if self._sock is None:
            return False
        self.steps += 1
        if result is not None and len(result) > MAX_RING_RESULT:
            result = None
        frame = _RING.pack(self.steps, NO_RESULT if result is None else len(result))
        try:
            self._sock.sendall(frame if result is None else frame + result)
            return result is not None
        except OSError as e:  # a timeout too: the stream may end mid-ring, so it ends here
            log.warning("step bell: ring %d failed (%s); the coordinator reads without it", self.steps, e)
        self.close()
        return False

    def wait_for_wake(self) -> None:
        """Park: sleep until the coordinator sends a wake byte or closes the bell (or its end
        went away). Without a bell there is nobody to wake this rank: it returns at once."""
        while self._sock is not None:
            select.select([self._sock], [], [])
            try:
                data = self._sock.recv(1)
            except (BlockingIOError, TimeoutError):
                continue
            except OSError:
                data = b""
            if not data:  # the bell closed: the graph is being torn down
                self.close()
            return

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = conn.recv(n - len(data))
        if not chunk:
            raise ConnectionError("step bell: a connection closed before it sent the key and an index")
        data += chunk
    return data
