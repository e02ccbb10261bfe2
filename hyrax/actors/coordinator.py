"""RoleCoordinator: the Ray actor of one role replica.

It owns the request table, the scheduler and every index allocator (the `Engine`), creates
and supervises its TP rank actors, and runs the step loop in a thread of its own. Clients
(the gateway) submit requests and take their tokens back through one Ray streaming generator
per gateway (`feed`), one message per engine step; admin calls retract, resume and inspect.

Faults: every rank call has a timeout. When a rank dies or hangs, the replica is marked
unhealthy, its ranks are replaced, and every request it held is rebuilt by recompute from
its tokens; if ranks cannot be restarted, the requests end with finish_reason "error" and the
replica is down: it refuses new requests at once (503) until the deployment controller replaces it.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from hyrax import heap
from hyrax.actors.engine.commands import Command, ListRequests, Pools
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.engine import Engine
from hyrax.actors.engine.feed_queue import IN_FLIGHT
from hyrax.actors.engine.feed_registry import FeedRegistry
from hyrax.actors.engine.gateway_leases import LEASE_EXPIRED, GatewayLeases
from hyrax.actors.engine.memory_budget import agree, with_capacities
from hyrax.actors.engine.pools import host_pool_rows, pool_sizes_for
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.hybrid import DTYPES
from hyrax.actors.model.sharding import TP, check_tp
from hyrax.actors.model.state import derive_components
from hyrax.actors.model.tokenizer import load_tokenizer
from hyrax.actors.rank import RankWorker
from hyrax.actors.ray_executor import RayExecutor
from hyrax.actors.restart_budget import RestartBudget

# A replica gives up (down: the deployment controller replaces it) when its ranks needed more than
# `max_rank_restarts` restarts within this window; restarts longer ago (a rank lost last week)
# no longer count against it. Down is final: the window passing does not bring a down replica back.
RESTART_WINDOW_S = 600.0
# what the clients of a replica that gave up on its ranks are told (the cause is in its health)
DOWN = "the replica lost its ranks and could not restart them"

log = logging.getLogger("hyrax.coordinator")


@ray.remote(num_cpus=0, max_restarts=0, max_concurrency=10_000)  # one coroutine per open stream
class RoleCoordinator:
    def __init__(self, role: str, replica: int, model_dir: str, tp_size: int, config: EngineConfig,
                 placement_group=None, rank_timeout_s: float = 60.0, max_rank_restarts: int = 3,
                 namespace: str = "hyrax"):
        self.role, self.replica = role, replica
        self.namespace = namespace  # the deployment's Ray namespace: its ranks are named there
        self.model_dir, self.tp_size, self.config = model_dir, tp_size, config
        self.pg = placement_group
        self.rank_timeout_s = rank_timeout_s
        self.cfg = ModelConfig.from_dir(model_dir)
        check_tp(self.cfg, tp_size)
        self.tokenizer = load_tokenizer(model_dir, self.cfg.vocab_size)
        self.ranks: list = []
        self.healthy = False
        self.restarts = 0  # over the replica's life
        self.restart_budget = RestartBudget(max_rank_restarts, RESTART_WINDOW_S)
        self.down = False  # its ranks failed again after every restart: it serves nothing any more
        self.last_error: str | None = None
        self.memory: list[str] = []  # what each rank measured (--gpu-memory-fraction), for health
        self.rank_heaps: list[dict] = []  # each rank's heap (heap.summary) once its pools were allocated
        self._start_ranks()
        # with --gpu-memory-fraction: the capacities the ranks agreed on; a step budget left to the
        # device: its default for the device the ranks run on
        config = self.config.for_device(self.device.split(":")[0])
        # the ranks resolved `auto` for the device they run on: the pools hold that dtype
        comps = derive_components(self.cfg, TP(0, tp_size), DTYPES[self.dtype])
        sizes = pool_sizes_for(comps, config)
        self.executor = RayExecutor(self.ranks, rank_timeout_s, compiled=config.compiled_graph,
                                    cpu_affinity=config.cpu_affinity == "auto")
        self.engine = Engine(comps, sizes, host_pool_rows(comps, sizes, config.host_pool_mb), self.executor,
                             config, self.cfg.vocab_size, self.cfg.max_position_embeddings,
                             self.cfg.eos_token_id, self.tokenizer.decode)
        self.loop = EngineLoop(self.engine, f"{role}-{replica}", on_rank_failure=self._recover,
                               probe=self._probe_ranks, rest=self._rest_ranks,
                               source=ray.get_runtime_context().current_actor, ack=_ack_remote)
        self.gateways = GatewayLeases()
        # one feed per consumer's event loop: its step batches, until it closes or its gateway's lease lapses
        self.feeds = FeedRegistry(lambda gateway: functools.partial(self.gateways.close, gateway))
        threading.Thread(target=self._expire_gateways, name="hyrax-gateway-leases", daemon=True).start()
        heap.settle()  # what the replica keeps for its life: the step loop's collections skip it (heap.py)

    # ---- ranks -------------------------------------------------------------------------
    def _rank_name(self, k: int) -> str:
        return f"hyrax/{self.role}/{self.replica}/rank{k}"

    def _start_ranks(self) -> None:
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        ranks = []
        try:
            for k in range(self.tp_size):
                opts = {"name": self._rank_name(k), "namespace": self.namespace, "lifetime": None}
                if self.pg is not None:
                    opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(self.pg,
                                                                                   placement_group_bundle_index=k)
                if _cuda_cluster():
                    opts["num_gpus"] = 1
                ranks.append(RankWorker.options(**opts).remote(self.role, self.replica, k, self.tp_size))
            infos = self._set_up(ranks)
        except BaseException:  # ranks that did not come up would keep their names and bundles: the next try needs both
            for r in ranks:
                ray.kill(r, no_restart=True)
            raise
        self.rank_heaps = [i["heap"] for i in infos]
        self.ranks[:] = ranks
        self.device = infos[0]["device"]
        self.attention_backend = infos[0]["attention_backend"]
        self.dtype = infos[0]["dtype"]
        self.healthy = True

    def _set_up(self, ranks: list) -> list[dict]:
        """Load the new ranks' shards and allocate their pools; what each rank reports."""
        addr = ray.get(ranks[0].dist_address.remote(), timeout=self.rank_timeout_s) if self.tp_size > 1 else None
        infos = ray.get([r.setup.remote(self.model_dir, self.config, addr) for r in ranks],
                        timeout=max(self.rank_timeout_s, 300))
        if self.config.gpu_memory_fraction is not None:
            # every rank measured its device: all take the smallest capacities, so every rank's
            # pools have the same shapes; replacement ranks are then built with these sizes
            self.memory = [i["memory"] for i in infos]
            self.config = with_capacities(self.config, agree([i["capacities"] for i in infos]))
            infos = [i | a for i, a in zip(infos, ray.get([r.allocate.remote(self.config) for r in ranks],
                                                          timeout=max(self.rank_timeout_s, 300)))]
        dtypes = {i["dtype"] for i in infos}
        if len(dtypes) != 1 or (getattr(self, "dtype", None) not in (None, *dtypes)):
            raise RuntimeError(f"the ranks of {self.role}/{self.replica} resolved different dtypes: {sorted(dtypes)}")
        return infos

    def _recover(self, err: Exception) -> None:
        """A rank failed: replace the ranks, rebuild every request by recompute. A replica that
        went down stays down, its restart window passed or not: the controller is replacing it,
        and ranks it brought back itself would serve outside the deployment (its closed loop
        calls no rank, so this is not reached again; a caller that did would restart nothing)."""
        if self.down:
            return
        self.healthy = self.loop.healthy = False
        self.last_error = str(err)
        while not self.loop.stopping and self.restart_budget.take(time.monotonic()):
            self.restarts += 1
            try:
                self._start_ranks()
                self.engine.reset_for_recovery()
                self.loop.healthy = True
                return
            except Exception as e:  # noqa: BLE001 - any failure to start counts as one attempt
                self.last_error = f"restart {self.restarts} failed: {e}"
                time.sleep(1.0)
        self.down = not self.loop.stopping  # the deployment controller replaces it (also if failing them raises)
        # its requests end, and new ones are refused at once (503) until the controller has replaced it
        ids = self.loop.close(DOWN)
        self.last_error = (f"replica down after {self.restart_budget.used()} rank restarts within "
                           f"{RESTART_WINDOW_S:g} s; failed {len(ids)} requests")

    def _probe_ranks(self) -> None:
        """The idle loop's liveness check (raises RankFailure); none once the replica gave up."""
        if self.healthy:
            self.executor.probe()

    def _rest_ranks(self) -> None:
        """The idle loop lets the ranks of a compiled graph sleep (step_bell.py)."""
        if self.healthy:
            self.executor.rest()

    # ---- client API: delegated to the engine loop --------------------------------------
    @ray.method(_generator_backpressure_num_objects=IN_FLIGHT)
    async def feed(self, feed_id: str, gateway: str | None = None):
        """Streaming generator: one message per engine step for all the streams opened with
        `submit(feed_id, ...)`, a list of (request id, item) in the order the engine made them
        (batches the gateway has not taken yet go out joined, folded once there are many). The
        gateway fans them out. At most IN_FLIGHT messages are on their way to a gateway that has
        not taken them; the rest wait here (feed_queue.py). It ends when the consumer closes the
        feed (`close_feed`) or its gateway's lease lapses."""
        async for batch in self.feeds.stream(feed_id, gateway):
            yield batch

    async def close_feed(self, feed_id: str) -> bool:
        """The consumer of `feed_id` is done with it (its client's feed task ended): the feed's
        generator returns and nothing of it stays here. False if there was no such feed."""
        return self.feeds.close(feed_id)

    async def submit(self, feed_id: str, request_id: str, prompt_ids: list[int], params: dict,
                     gateway: str | None = None) -> None:
        """Start a request whose items go out on `feed_id` ({"token_ids", "finished",
        "finish_reason"}, ...). `gateway`: the id of the gateway whose lease keeps it alive."""
        sink = self.feeds.sink(feed_id, gateway)
        self.gateways.open(gateway, request_id)
        self.loop.submit(request_id, prompt_ids, params, sink)

    async def submit_imported(self, feed_id: str, handoff: dict, gateway: str | None = None) -> None:
        """`submit` for a request handed over by another replica (PD or migration)."""
        sink = self.feeds.sink(feed_id, gateway)
        self.gateways.open(gateway, handoff["request"]["id"])
        self.loop.submit_imported(handoff, sink)

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict, gateway: str | None = None):
        """One request's own streaming generator (tests, scripts): yields its items one by one."""
        self.gateways.open(gateway, request_id)
        try:
            async for item in self.loop.generate(request_id, prompt_ids, params):
                yield item
        finally:
            self.gateways.close(gateway, request_id)

    async def generate_imported(self, handoff: dict, gateway: str | None = None):
        """`generate` for a request handed over by another replica."""
        rid = handoff["request"]["id"]
        self.gateways.open(gateway, rid)
        try:
            async for item in self.loop.generate_imported(handoff):
                yield item
        finally:
            self.gateways.close(gateway, rid)

    def renew_gateway(self, gateway: str, lease_s: float, job: str | None = None) -> None:
        """A gateway is alive: keep its streams for another `lease_s` seconds. `job`: the Ray job
        id of its process (what tells, once its lease ran out, whether that process is gone)."""
        self.gateways.renew(gateway, lease_s, job)

    def _expire_gateways(self) -> None:
        """Abort the streams of gateways that stopped renewing (their process is gone or frozen),
        free the offers whose hand-offs they carry (to an importer they will not reach now), and
        end their feeds once their process is gone.

        A feed is not ended while its gateway may be frozen (SIGSTOP, a node that stopped
        answering): Ray ends a streaming generator by waiting, on this actor's event loop, until
        its caller acknowledged every item sent, which a frozen caller never does; the replica
        would answer nothing (health included) until the gateway went on, and be killed as hung.
        So a lapsed gateway's feeds end when Ray reports its job dead (its unacknowledged items
        then fail at once); one that renews again reads them again. Without a job, at once."""
        waiting: dict[str, str] = {}  # lapsed gateway -> its job, until that is dead or it renews
        checked = 0.0
        while not self.loop.stopping:
            for rid in self.gateways.expired():
                try:
                    self.loop.abort(rid, reason=LEASE_EXPIRED)
                except Exception:  # noqa: BLE001 - a rank gone mid-abort is the loop's to recover; leases go on
                    log.exception("aborting %s, whose gateway's lease ran out, failed", rid)
            for gateway, job in self.gateways.take_lapsed():
                try:  # the offers it carries would reach no importer: freed with its streams
                    self.loop.reclaim_offers(gateway)
                except Exception:  # noqa: BLE001 - as for an abort: the leases go on
                    log.exception("reclaiming the offers of %s, whose lease ran out, failed", gateway)
                if job is None:
                    self.feeds.close_gateway_soon(gateway)
                else:
                    waiting[gateway] = job
            if waiting and time.monotonic() - checked >= 1.0:
                checked = time.monotonic()
                dead = _dead_jobs()
                for gateway, job in list(waiting.items()):
                    if self.gateways.knows(gateway):  # back (it was frozen): it reads its feeds again
                        del waiting[gateway]
                    elif job in dead:  # its process is gone: so are its feeds' readers
                        del waiting[gateway]
                        self.feeds.close_gateway_soon(gateway)
            time.sleep(0.25)

    def release(self, request_id: str) -> None:
        """An importer took this replica's hand-off of `request_id`: free it here. Queued on the
        event loop, not sent to a worker thread, so that it takes effect before any call that
        arrives after it: a request migrated away and back imports here again only once its
        first hand-off is released (from a thread, the later import could be admitted first and
        find the id in use). Queued, not applied here: the loop's lock can be held for a whole
        step, or a whole rank restart, and this event loop must go on answering health checks,
        taking lease renewals and streaming meanwhile."""
        self.loop.release_soon(request_id)

    # Other calls that take the engine loop's lock run in a worker thread: a step in flight holds
    # the lock for the whole step, and this actor's event loop must keep streaming every gateway's
    # tokens and taking submissions meanwhile (an abort from a client that left, a dashboard's
    # poll of the pools, a metrics scrape waited for a step on the event loop before).

    async def run(self, cmd: Command):
        """A gateway's command (commands.py): the replica's requests and pools are named by
        role and replica here; every other command goes to the engine loop as it is."""
        return await asyncio.to_thread(self._run, cmd)

    def _run(self, cmd: Command):
        match cmd:
            case ListRequests():
                return self._list_requests()
            case Pools():
                return self._pools()
        return self.loop.run(cmd)

    async def list_requests(self) -> list[dict]:
        return await asyncio.to_thread(self._list_requests)

    def _list_requests(self) -> list[dict]:
        reqs = self.loop.list_requests()
        for r in reqs:
            r["role"], r["replica"] = self.role, self.replica
        return reqs

    async def pools(self) -> dict:
        return await asyncio.to_thread(self._pools)

    def _pools(self) -> dict:
        return {"role": self.role, "replica": self.replica, "tp_size": self.tp_size,
                "components": self.loop.pools()}

    async def check_invariants(self) -> bool:
        return await asyncio.to_thread(self.loop.check_invariants)

    async def is_idle_clean(self) -> bool:
        return await asyncio.to_thread(self.loop.is_idle_clean)

    def load(self) -> int:
        return self.loop.load()

    def health(self) -> dict:
        return {"role": self.role, "replica": self.replica, "healthy": self.healthy, "down": self.down,
                # replacing its ranks after a rank failure (_recover), neither down nor given up
                "restarting": not self.healthy and not self.down and not self.loop.stopping,
                "stuck": self.loop.stuck_reason(),
                "restarts": self.restarts, "last_error": self.last_error, "tp_size": self.tp_size,
                "gateway_leases": self.gateways.summary(), "feeds": self.feeds.summary(),
                "device": self.device, "attention_backend": self.attention_backend, "memory": self.memory,
                "step_path": self.executor.step_path,
                "heap": heap.summary(), "rank_heaps": self.rank_heaps}

    async def stats(self) -> dict:
        return await asyncio.to_thread(self.loop.stats)

    def rank_handles(self) -> list:
        return list(self.ranks)

    def shutdown(self) -> None:
        self.loop.shutdown()
        for r in self.ranks:
            ray.kill(r, no_restart=True)
        self.executor.close()


def _ack_remote(source, request_id: str) -> None:
    """Tell the offering coordinator its hand-off was taken (fire and forget: if this is lost,
    the offer's lease frees it there)."""
    source.release.remote(request_id)


def _dead_jobs() -> set[str]:
    """The ids (hex) of the Ray jobs whose driver is gone; none when Ray does not answer."""
    from ray._private import state  # the GCS job table (what `ray list jobs` reads)

    try:
        return {j["JobID"] for j in state.jobs() if j["IsDead"]}
    except Exception:  # noqa: BLE001 - the GCS is busy or restarting: ask again next time
        log.warning("could not read the job table", exc_info=True)
        return set()


def _cuda_cluster() -> bool:
    return ray.cluster_resources().get("GPU", 0) > 0
