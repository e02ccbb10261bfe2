"""The per-step fan-out to a replica's rank actors as a Ray Compiled Graph.

Every step sends one plan to every rank and waits for every answer. As plain actor calls
that costs ~1.3 ms a step on an idle 2-core machine and ~3.4 ms while the rank's core is busy
(a task submission, a scheduling round trip through the raylet, an object for the result);
a compiled graph (`ray.dag`, `experimental_compile`) reuses shared-memory channels set up
once: ~0.3 ms idle, ~1.0 ms busy, same machine, same payload (a 32-entry plan).

What the graph changes for the ranks: Ray runs compiled tasks on a thread of their own in
each rank actor, while plain calls (save, load, discard, ...) still run on the actor's main
thread, so `RankWorker` serialises its calls with a lock. The engine never issues a state
move that depends on a step still in flight (it commits that step first, and rows a step
may write are freed only after it commits), so the lock's order is enough.

Waiting for a step's result, the coordinator sleeps on a doorbell the ranks ring at the end of
each graph step (step_bell.py): Ray's channel read polls, so a coordinator blocked in it burns a
core the ranks' forward may need. The ring carries the step's result; the graph's output then
only says so (`WITH_RING`), and the coordinator reads it after sending the next step, when Ray
has long written it (every output must be read, in order, or the graph stops taking steps).
A step that raised rings without a result, and the coordinator reads its error from the graph.

Plans and results cross the graph as bytes pickled here (`to_wire`/`from_wire`): Ray's own
serializer (cloudpickle) took 0.6-1.1 ms for a 32-request plan on the 2-core box, the standard
pickle 0.16-0.24 ms, and Ray passes bytes through in microseconds.

When the graph cannot be built (a Ray without `ray.dag`, an actor already in another
graph), the executor keeps plain actor calls and says why (`RayExecutor.step_path`). When a
rank fails, the graph goes with it: the coordinator kills and replaces the ranks, and the
next step compiles a graph over the new ones.
"""
from __future__ import annotations

import pickle
import threading
import time

from hyrax.actors.step_bell import StepBell

# the plan of a step that parks every rank until the bell wakes it (step_bell.py): not a pickle,
# so no plan a step sends can be mistaken for it
PARK = b"park"
PARKED = b""  # what a park step answers
WITH_RING = b"with-ring"  # a step's answer when its result went with the rank's ring (not a pickle)

BELL_CONNECT_S = 30.0  # how long the ranks get to connect to a new graph's bell


def to_wire(obj) -> bytes:
    """A plan or a step result as it crosses the graph."""
    return pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)


def from_wire(data: bytes):
    return pickle.loads(data)


def _actor_ids(ranks: list) -> tuple:
    return tuple(r._actor_id for r in ranks)


class CompiledSteps:
    """One compiled graph: the plan in, every rank's `execute` result out, in rank order; and
    the doorbell its ranks ring after each step (`RankWorker.execute_and_ring`).

    Built, it runs one park step and reads its outputs while every rank is alive: Ray registers
    this process as the reader of a rank's output channel only at its first read, and a graph torn
    down unread (an idle replica parks its ranks as soon as the graph is built; then one is
    killed) registered it in the teardown, after the dead rank's buffers had gone, where a CHECK
    in Ray's core worker (ray 2.60) aborted the whole coordinator instead of raising."""

    def __init__(self, ranks: list, timeout_s: float = BELL_CONNECT_S):
        import ray
        from ray.dag import InputNode, MultiOutputNode

        self.graph = None
        self.bell = StepBell(ray.util.get_node_ip_address(), len(ranks))
        try:
            joined = [r.ring_step_bell_at.remote(self.bell.address, k, self.bell.key) for k, r in enumerate(ranks)]
            ray.get(joined, timeout=BELL_CONNECT_S)  # connected: the listen backlog holds them
            self.bell.accept(BELL_CONNECT_S)
            with InputNode() as plan:
                dag = MultiOutputNode([r.execute_and_ring.bind(plan) for r in ranks])
            self.graph = dag.experimental_compile()
        except BaseException:
            self.bell.close()
            raise
        self.over = _actor_ids(ranks)
        self.sent = 0  # steps submitted: the rings a step's collect waits for
        self.unread: list = []  # refs of outputs that said WITH_RING: read after the next send
        self.timeout_s = timeout_s  # how long reading one of them may take (the executor's rank timeout)
        self.parked: tuple[int, list] | None = None  # the park step in flight: (its number, its refs)
        try:  # one park step, woken and read at once, before the graph is handed out
            self.park()
            self.unpark(time.monotonic() + BELL_CONNECT_S)
        except BaseException:
            self.close()
            raise

    def serves(self, ranks: list) -> bool:
        """Whether the graph was built over these very actors (not replaced ones)."""
        return _actor_ids(ranks) == self.over

    def submit(self, plan) -> tuple[int, list]:
        """Start a step on every rank: (its number in this graph, one ref per rank for `ray.get`;
        each answers its result `to_wire`)."""
        return self._send(to_wire(plan))

    def _send(self, wire: bytes) -> tuple[int, list]:
        refs = self.graph.execute(wire)
        self.sent += 1
        self._read_unread()
        return self.sent, refs

    def _read_unread(self) -> None:
        """Read the outputs whose results came with the ranks' rings: written by now (the rank
        rang just before Ray wrote them), so this does not wait; Ray needs each read, in order.
        Raises what reading raises (the rank died since)."""
        import ray

        unread, self.unread = self.unread, []
        for ref in unread:
            got = ray.get(ref, timeout=self.timeout_s)
            if got != WITH_RING:
                raise RuntimeError(f"a step's result came with the rank's ring, but the graph answered {got[:32]!r}")

    def park(self) -> None:
        """Park every rank until `unpark` (the replica is idle): no rank polls for a plan."""
        if self.parked is None:
            self.parked = self._send(PARK)

    def unpark(self, deadline: float) -> None:
        """Wake the parked ranks and collect the park step; raises what reading a step raises
        (a rank that died while parked). Does nothing when the ranks are not parked."""
        import ray

        if self.parked is None:
            return
        (step, refs), self.parked = self.parked, None
        self.bell.wake()
        self.bell.wait(step, deadline)
        for k in self.bell.read_order():
            ray.get(refs[k], timeout=max(deadline - time.monotonic(), 0.01))

    def wait(self, step: int, deadline: float) -> None:
        """Sleep until every rank rang for this graph's `step`-th step (its result is then in
        the channel or about to be), a rank's bell ended, or `deadline` (time.monotonic());
        reading the refs comes next."""
        self.bell.wait(step, deadline)

    def close(self, wait: bool = False) -> None:
        """Tear the graph down. Without `wait` the caller does not block: with a rank hung
        inside a step, Ray waits up to its teardown timeout (30 s) for the task to end. With
        it, the ranks can join another graph as soon as this returns."""
        graph, self.graph = self.graph, None
        # dropped only once the graph is down: an unread ref let go before would have Ray read
        # its output first, with no timeout, and a rank that died after ringing never writes it
        unread, self.unread = self.unread, []
        if graph is None:
            return
        self.bell.close()  # the ranks' next ring fails and closes their end

        def down():
            graph.teardown()
            unread.clear()
        t = threading.Thread(target=down, name="hyrax-graph-teardown", daemon=True)
        t.start()
        if wait:
            t.join()


def compile_steps(ranks: list, timeout_s: float = BELL_CONNECT_S) -> tuple[CompiledSteps | None, str]:
    """(the graph, "compiled graph"), or (None, why plain actor calls are used instead)."""
    try:
        return CompiledSteps(ranks, timeout_s), "compiled graph"
    except Exception as e:  # noqa: BLE001 - any reason the graph cannot be built means the fallback
        return None, f"actor calls ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
