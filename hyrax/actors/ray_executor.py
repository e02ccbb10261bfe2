"""Executor over a replica's TP rank actors (Ray): every call fans out concurrently, one wait
per call, with a timeout, so a dead or hung rank surfaces as `RankFailure` instead of a hang.
Steps go through a compiled graph over the ranks (step_graph.py) unless it cannot be built;
state moves are plain actor calls."""
from __future__ import annotations

import logging
import time
from dataclasses import replace

import ray

from hyrax.actors.cpu_claims import keep_off, restore
from hyrax.actors.engine.executor import RankCalls, RankFailure, Sums, step_error
from hyrax.actors.engine.moves import Location, Place, Rows
from hyrax.actors.engine.plan import StepPlan, StepResult
from hyrax.actors.step_graph import WITH_RING, CompiledSteps, compile_steps, from_wire, to_wire

log = logging.getLogger(__name__)

# after one rank raised in a step, how long the others get to answer before the step counts
# as a rank failure (a rank left waiting in a collective never answers)
OTHERS_GRACE_S = 10.0


class RayExecutor(RankCalls):
    def __init__(self, ranks: list, timeout_s: float, compiled: bool = False, cpu_affinity: bool = False):
        self.ranks = ranks  # the coordinator replaces them in place after a rank failure
        self.timeout_s = timeout_s
        # this process keeps off the CPUs the ranks claimed while a graph lasts (cpu_claims.py)
        self.cpu_affinity = cpu_affinity
        self._pinned: set[int] | None = None  # this process's CPUs before it kept off its ranks'
        self.num_ranks = len(ranks)
        self.compiled = compiled
        self._graph: CompiledSteps | None = None
        self._graph_tried: tuple | None = None  # the ranks a failed compile was tried over
        self.step_path = "compiled graph (built at the first step)" if compiled else "actor calls (no --compiled-graph)"

    def _wait(self, what: str, refs: list) -> list:
        try:
            return ray.get(refs, timeout=self.timeout_s)
        except Exception as e:  # RayActorError, GetTimeoutError, task errors
            raise RankFailure(f"{what} failed on a rank: {type(e).__name__}: {e}") from e

    def _each(self, method: str, *args) -> list:
        return self._wait(method, [getattr(r, method).remote(*args) for r in self.ranks])

    def probe(self) -> None:
        """Every rank answers a ping within the rank timeout, or RankFailure (dead or hung)."""
        self._each("ping")

    def save(self, req_id: str, rows: Rows, location: Location) -> tuple[Sums, list | None]:
        """To the object store: checksums come back now, the shards stay there, as refs."""
        if location.place != Place.OBJECT_STORE:
            return super().save(req_id, rows, location)
        pairs = [r.save.options(num_returns=2).remote(req_id, rows, location) for r in self.ranks]
        return dict(enumerate(self._wait("save", [p[0] for p in pairs]))), [p[1] for p in pairs]

    def load(self, req_id: str, rows: Rows, location: Location, expect: Sums) -> dict[int, dict]:
        """Shard refs travel as arguments of their own (RankWorker.load), so Ray fetches them."""
        shards = location.payload if location.place == Place.OBJECT_STORE else ()
        return dict(enumerate(self._each("load", req_id, rows, replace(location, payload=None), expect, *shards)))

    def submit(self, plan: StepPlan):
        """Send a step to every rank without waiting; steps run in submission order."""
        graph = self._graph_over_ranks()
        if graph is None:
            wire = to_wire(plan)  # bytes: Ray passes them through (RankWorker.execute_wire)
            return [r.execute_wire.remote(wire) for r in self.ranks]
        try:
            graph.unpark(time.monotonic() + self.timeout_s)
            return _GraphStep(graph, *graph.submit(plan))
        except Exception as e:  # a rank died (its channel is closed) or stopped reading plans
            self.close()
            raise RankFailure(f"execute could not be sent: {type(e).__name__}: {e}") from e

    def rest(self) -> None:
        """The replica has nothing to run: park the ranks of its compiled graph (building it
        first, so the first request does not wait for it), so that no idle rank polls its
        channel; the next `submit` wakes them. Plain actor calls need nothing."""
        graph = self._graph_over_ranks()
        if graph is None:
            return
        try:
            graph.park()
        except Exception as e:  # a rank died (its channel is closed)
            self.close()
            raise RankFailure(f"parking the ranks failed: {type(e).__name__}: {e}") from e

    def _graph_over_ranks(self) -> CompiledSteps | None:
        """The compiled graph over the current ranks: built at the first step and again after
        the ranks were replaced; None where it cannot be built (then plain actor calls)."""
        if not self.compiled:
            return None
        if self._graph is not None and self._graph.serves(self.ranks):
            return self._graph
        self.close()
        ids = tuple(r._actor_id for r in self.ranks)
        if self._graph_tried != ids:
            self._graph_tried = ids
            self._graph, self.step_path = compile_steps(self.ranks, self.timeout_s)
            if self._graph is not None and self.cpu_affinity:
                self._keep_off_ranks()  # the ranks claimed their CPUs when they joined the graph
        return self._graph

    def _keep_off_ranks(self) -> None:
        """Pin this process (the coordinator: the thread that steps the graph, and every other) off
        the CPUs this replica's ranks on this machine claimed (cpu_claims.py); CPUs other
        replicas' ranks claimed stay in use."""
        try:
            claims = ray.get([r.cpu_claim.remote() for r in self.ranks], timeout=self.timeout_s)
            here = ray.get_runtime_context().get_node_id()
        except Exception as e:  # noqa: BLE001 - a rank that cannot say is one not kept off; its step says the rest
            log.info("coordinator: the ranks' CPU claims are unknown (%s: %s); it stays where it is", type(e).__name__, e)
            return
        self._pinned = keep_off({cpu for c in claims if c and c["node"] == here for cpu in c["cpus"]})

    def close(self, wait: bool = False) -> None:
        """Tear down the compiled graph (a rank failed, the ranks were replaced, shutdown);
        `wait`: until the ranks are free to join another graph."""
        if self._graph is not None:
            self._graph.close(wait)
            self._graph = None
        if self._pinned is not None:
            cpus, self._pinned = self._pinned, None
            restore(cpus)

    def collect(self, handle) -> StepResult:
        """Rank 0's result, with every rank's checkpoint checksums. A rank that raised while every rank answered is a StepError (the
        ranks live on); a rank that died, hung or left the others waiting is a RankFailure."""
        if isinstance(handle, _GraphStep):
            return StepResult.gathered(self._collect_graph(handle))
        refs = handle
        try:
            results = ray.get(refs, timeout=self.timeout_s)
        except ray.exceptions.RayTaskError as e:
            answered, _ = ray.wait(refs, num_returns=len(refs), timeout=min(self.timeout_s, OTHERS_GRACE_S))
            if len(answered) == len(refs) and not isinstance(e, ray.exceptions.RayActorError):
                raise step_error(e.cause, "a rank") from e  # an out-of-memory is its own type
            raise RankFailure(f"execute failed on a rank: {type(e).__name__}: {e}") from e
        except Exception as e:  # RayActorError, GetTimeoutError
            raise RankFailure(f"execute failed on a rank: {type(e).__name__}: {e}") from e
        return StepResult.gathered([from_wire(r) for r in results])

    def _collect_graph(self, step: _GraphStep) -> list:
        """Every rank's answer from the graph, one ref each (each must be read, once), read
        after the ranks rang the graph's bell (until then this thread sleeps)."""
        deadline = time.monotonic() + self.timeout_s
        step.graph.wait(step.step, deadline)
        results, raised = [None] * len(step.refs), None
        bell = step.graph.bell
        carried = bell.take(step.step)
        for k in bell.read_order():  # a rank whose bell ended (died) first
            try:
                if carried[k] is not None:  # it came with the ring; the graph's output is read later
                    results[k] = from_wire(carried[k])
                    step.graph.unread.append(step.refs[k])
                    continue
                got = ray.get(step.refs[k], timeout=max(deadline - time.monotonic(), 0.01))
                if got == WITH_RING:  # its ring was not read: the wait ended early, another rank's bell ended
                    ring = bell.result_of(k, step.step, deadline)
                    if ring is None:
                        raise RuntimeError("the rank's result went with a ring its bell did not deliver whole")
                    got = ring
                results[k] = from_wire(got)
            except ray.exceptions.RayTaskError as e:
                if isinstance(e, ray.exceptions.RayActorError):
                    self.close()
                    raise RankFailure(f"execute failed on a rank: {type(e).__name__}: {e}") from e
                raised = raised or e
                deadline = min(deadline, time.monotonic() + OTHERS_GRACE_S)
            except Exception as e:  # ActorDiedError, RayChannelTimeoutError, RayChannelError
                self.close()
                raise RankFailure(f"execute failed on a rank: {type(e).__name__}: {e}") from e
        if raised is not None:
            raise step_error(raised.cause, "a rank") from raised  # an out-of-memory is its own type
        return results


class _GraphStep:
    """A step sent through a compiled graph: the graph, the step's number in it, one ref per rank."""

    def __init__(self, graph: CompiledSteps, step: int, refs: list):
        self.graph, self.step, self.refs = graph, step, refs
