"""Engine-client backends over Ray RoleCoordinator handles."""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import threading
import uuid
from typing import AsyncIterator

import ray

from hyrax.actors.engine.commands import Abort, Command
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.step_feed import Fanout, error_item, is_last, refusal_item
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.tokenizer import chat_template, load_tokenizer
from hyrax.api.client import EngineClient, ModelInfo


class GatewayLease:
    """This gateway's lease on every replica it streams from: renewed every third of `lease_s`
    from a thread of its own (a busy event loop does not let it lapse). When this process dies
    the renewals stop, and each replica aborts the streams this gateway held once the lease runs
    out (hyrax/actors/engine/gateway_leases.py): nothing waits on a consumer that is gone."""

    def __init__(self, handles: list, lease_s: float = 10.0):
        self.id = f"gw-{uuid.uuid4().hex[:12]}"
        self.handles, self.lease_s = list(handles), lease_s
        # this process's Ray job: a replica ends this gateway's feeds once its lease ran out and
        # Ray reports the job dead (not before: the process may only be frozen)
        self.job = ray.get_runtime_context().get_job_id() if ray.is_initialized() else None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hyrax-gateway-lease", daemon=True)

    def start(self) -> "GatewayLease":
        self.renew()
        self._thread.start()
        return self

    def renew(self) -> None:
        for h in self.handles:  # fire and forget: a replica that is down is the health check's business
            h.renew_gateway.remote(self.id, self.lease_s, self.job)

    def add(self, handle) -> None:
        """A replica joined: renew on it now, not at the next round (a third of the lease away): a
        stream opened there before the first renewal holds only the replica's default lease."""
        self.handles.append(handle)
        handle.renew_gateway.remote(self.id, self.lease_s, self.job)

    def _run(self) -> None:
        while not self._stop.wait(self.lease_s / 3):
            self.renew()

    def stop(self) -> None:
        self._stop.set()


class RayBackend:
    def __init__(self, handle, role: str, index: int, timeout_s: float = 60.0, gateway: str | None = None):
        self.handle, self.role, self.index = handle, role, index
        self.timeout_s = timeout_s
        # what a call raises when the replica is gone or gave no answer in time (not a bug of its
        # own): EngineClient's views leave such a replica out
        self.unreachable = REPLICA_LOST + (TimeoutError,)
        self.gateway = gateway  # this gateway's lease id, sent with every stream it opens
        self._feed: ReplicaFeed | None = None
        self._aborts: set[asyncio.Future] = set()  # aborts sent and not answered yet (kept from the GC)

    async def run(self, cmd: Command):
        """Send a command (hyrax/actors/engine/commands.py) to the replica's coordinator."""
        return await asyncio.wait_for(self.handle.run.remote(cmd), self.timeout_s)

    def feed(self) -> "ReplicaFeed":
        """This gateway's one stream of step batches from the replica (a new one once it ended)."""
        if self._feed is None or self._feed.ended or self._feed.aloop is not asyncio.get_running_loop():
            self._feed = ReplicaFeed(self.handle, self.gateway)
        return self._feed

    def generate(self, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        sp = SamplingParams(**params) if isinstance(params, dict) else params
        if sp.seed is None:  # drawn here and sent: a hand-off after a loss samples on with the replica's seed
            sp = dataclasses.replace(sp, seed=random.getrandbits(62))
            params = {**params, "seed": sp.seed} if isinstance(params, dict) else sp
        request = {"id": request_id, "prompt_ids": list(prompt_ids), "output_ids": [], "params": sp,
                   "seed": sp.seed, "retractions": 0}
        return self._follow(request, lambda feed: self.handle.submit.remote(feed.id, request_id, prompt_ids, params,
                                                                            gateway=self.gateway))

    def generate_imported(self, handoff: dict) -> AsyncIterator[dict]:
        request = dict(handoff["request"], output_ids=list(handoff["request"]["output_ids"]))
        return self._follow(request, lambda feed: self.handle.submit_imported.remote(feed.id, handoff,
                                                                                     gateway=self.gateway))

    async def _follow(self, request: dict, submit) -> AsyncIterator[dict]:
        """One request's items, fanned out from the replica's feed. If the replica is lost
        mid-stream, the stream ends with a hand-off that carries no state, only the request's
        tokens so far (`request`, kept up to date here): the engine client hands it to another
        replica like any hand-off, which rebuilds the state by prefill over prompt + output
        (recompute) and continues the same stream. The lost replica held the only copy of the
        state, so recompute is the one way back; the tokens the client already has are never
        regenerated.

        A replica whose actor died before the submission's answer refuses it (`refusal_item`):
        a coordinator is never restarted (max_restarts=0), so whatever the call reached went
        with it, and nothing it sent for the request is passed on; the engine client sends the
        request to another replica. Any other loss (an actor Ray finds unavailable may have run
        the call) takes the hand-off path above."""
        rid = request["id"]
        feed = self.feed()
        q, finished = feed.fanout.open(rid), False
        try:
            try:
                await submit(feed)
            except ray.exceptions.ActorDiedError:
                finished = True  # nothing to abort there
                yield refusal_item(GONE)
                return
            except REPLICA_LOST:
                q.put_nowait(LOST)
            while not finished:
                item = await q.get()
                if item is LOST:
                    # an actor Ray found unavailable (not dead) may be alive and running the request,
                    # which goes on elsewhere now: it must end there, or two replicas would own it
                    self._abort_there(rid)
                    item = {"token_ids": [], "finished": False, "finish_reason": None,
                            "handoff": {"request": request, "manifest": None, "payload": [], "lease_s": 0.0,
                                        "source": None}}
                elif isinstance(item, FeedEnd):
                    # the feed ended, not the request: it may still run there (submitted on a feed the
                    # replica had closed, after this gateway's lease lapsed), its items dropped
                    self._abort_there(rid)
                    item = dict(item.item)
                elif item.get("error") is None:
                    request["output_ids"].extend(item.get("token_ids") or [])
                finished = is_last(item)
                yield item
        finally:
            feed.fanout.close(rid, q)
            if not finished:  # the consumer went away: free the request on the replica now
                self._abort_there(rid)

    def _abort_there(self, rid: str) -> None:
        """Tell the replica to end `rid`, without waiting for its answer. One that arrives before
        the request's submission is kept as an early abort; a replica that is gone answers with
        an error, which is only logged."""
        async def abort():
            try:
                await self.handle.run.remote(Abort(rid))
            except Exception as e:  # noqa: BLE001 - gone, or unreachable for good: nothing holds it there
                logging.getLogger("hyrax.gateway").debug("abort of %s on %s/%d: %s", rid, self.role, self.index, e)
        task = asyncio.ensure_future(abort())
        self._aborts.add(task)
        task.add_done_callback(self._aborts.discard)

    def cut_streams(self, message: str) -> None:
        """End every stream this gateway has open on the replica now, each with a 503 error
        `message`, without waiting for the replica: the cluster it ran on is gone, and Ray may take
        a minute to say so."""
        if self._feed is not None:
            self._feed.cut(FeedEnd(error_item(message, 503)))

    async def health(self) -> dict:
        try:
            return await asyncio.wait_for(self.handle.health.remote(), 5.0)
        except Exception as e:  # noqa: BLE001 - unreachable counts as unhealthy
            return {"role": self.role, "replica": self.index, "healthy": False, "last_error": type(e).__name__}


# A replica that is gone (its node lost, its process killed): the stream's actor died, or the
# objects it had yielded died with it. An error raised by the replica's own code is not one.
REPLICA_LOST = (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError)
LOST = object()  # what each open stream of a feed gets when its replica is lost


@dataclasses.dataclass(frozen=True)
class FeedEnd:
    """What each open stream of a feed gets when the feed ends while its replica lives on (the
    replica closed it, as it does when this gateway's lease lapsed; or it failed): `item`, the
    stream's last item. The request is not known to have ended there, so the stream aborts it."""
    item: dict


GONE = "the replica is gone"  # a refusal by a replica whose actor died (the controller replaces it)


class ReplicaFeed:
    """The one stream of step batches (hyrax/actors/engine/step_feed.py) a replica sends this
    gateway, fanned out to the queues of the requests it streams: one Ray message per engine
    step, not one per token per request. When the replica is lost, every open stream gets
    `LOST`; when the feed ends or fails otherwise, `FeedEnd` (an error item) ends each of them."""

    def __init__(self, handle, gateway: str | None):
        self.id = f"feed-{uuid.uuid4().hex[:12]}"
        self.fanout = Fanout()
        self.ended = False
        self.messages = 0  # batches received
        self.aloop = asyncio.get_running_loop()
        self.handle = handle
        self._task = asyncio.ensure_future(self._pump(handle.feed.remote(self.id, gateway=gateway)))

    def cut(self, end: "FeedEnd") -> None:
        """End each stream open on this feed with `end` now. A stream ends at the first end it
        reads, so the pump's own, once Ray reports the replica lost, finds none of them left."""
        self.ended = True
        self.fanout.broadcast(end)

    async def _pump(self, stream) -> None:
        try:
            async for ref in stream:
                batch = await ref
                self.messages += 1
                self.fanout.dispatch(batch)
            end: object = FeedEnd(error_item("the replica's feed ended", 503))  # the server's side: retry elsewhere
        except asyncio.CancelledError:  # this side is done (its event loop is closing): so is the
            self.ended = True            # feed on the replica, which would otherwise wait on it forever
            try:
                self.handle.close_feed.remote(self.id)
            except Exception as e:  # noqa: BLE001 - Ray already shut down, or the replica gone: nothing to close
                logging.getLogger("hyrax.gateway").debug("closing feed %s: %s", self.id, e)
            raise
        except REPLICA_LOST:
            end = LOST
        except Exception:  # noqa: BLE001 - every stream of this feed must end, whatever happened
            logging.getLogger("hyrax.gateway").exception("a replica's feed failed")
            end = FeedEnd(error_item("the replica's feed failed", 503))  # what failed is in the log, not for clients
        self.ended = True
        self.fanout.broadcast(end)


class Membership:
    """Keeps a gateway's engine client in step with its deployment while the controller scales
    it: a replica added is routed to; a replica retired takes no new requests here and this
    gateway migrates the requests it streams from it (`client.drain`); a replica removed leaves
    the client. Runs as a task on the gateway's event loop, asking the controller once a second."""

    REMIND_S = 60.0  # while refreshes keep failing, one log line this often

    def __init__(self, controller, client: EngineClient, lease: GatewayLease | None, generation: int,
                 interval_s: float = 1.0, on_gone=None, on_added=None):
        self.controller, self.client, self.lease = controller, client, lease
        self.generation, self.interval_s = generation, interval_s
        self.on_gone = on_gone  # called once, with why, when the deployment is gone for good
        # called after a refresh that added replicas (hyrax serve: the gateway keeps off the CPUs
        # their ranks claimed, as it did off the first ones' at start: cpu_claims.py)
        self.on_added = on_added
        self._draining: set[tuple[str, int]] = set()
        self._tasks: set = set()

    async def run(self) -> None:
        """Ask the controller for the deployment's replicas every `interval_s`. A controller that
        died for good (it is restarted after any failure, so the deployment was torn down) ends
        the task and tells `on_gone`. A controller that is busy or unreachable keeps what the gateway has; its first failure is logged with the
        traceback, then one line every REMIND_S while they go on (a gateway attached to a
        deployment whose server stopped would otherwise log a traceback a second), and the
        refresh that works again says how many failed."""
        log, loop = logging.getLogger("hyrax.gateway"), asyncio.get_running_loop()
        failed, reminded = 0, 0.0
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                info = await self.controller.describe.remote()
                if info.generation != self.generation:
                    self.apply(info)
            except ray.exceptions.ActorDiedError:  # restarted whenever it fails: dead only when torn down
                why = ("the deployment was torn down (its server stopped, or hyrax undeploy): this gateway has "
                       "nothing left to serve and stops")
                if self.on_gone is not None:
                    self.on_gone(why)
                else:
                    log.warning("%s", why)
                return
            except Exception as e:  # noqa: BLE001 - the controller is busy or gone: keep what we have, ask again
                failed += 1
                if failed == 1:
                    reminded = loop.time()
                    log.warning("deployment membership refresh failed", exc_info=True)
                elif loop.time() - reminded >= self.REMIND_S:
                    reminded = loop.time()
                    log.warning("deployment membership refresh still failing (%d times): %s: %s", failed,
                                type(e).__name__, str(e).strip().splitlines()[0] if str(e).strip() else "")
                continue
            if failed:
                log.warning("deployment membership refresh works again after %d failed", failed)
                failed = 0

    def apply(self, info) -> None:
        self.generation = info.generation
        c = self.client
        have = {(b.role, b.index): b for b in c.backends}
        gateway = self.lease.id if self.lease is not None else None
        added = False
        for r in info.replicas + info.retiring:
            if (r.role, r.index) not in have:
                added = True
                have[(r.role, r.index)] = RayBackend(r.coordinator, r.role, r.index, gateway=gateway)
                if self.lease is not None:
                    self.lease.add(r.coordinator)
        keep = {(r.role, r.index) for r in info.replicas + info.retiring}
        for key, b in have.items():
            if key not in keep:
                c.draining.discard(id(b))
        c.backends = [b for key, b in have.items() if key in keep]
        for r in info.replicas:  # retired here before, serving again (a restarted controller forgot it)
            key = (r.role, r.index)
            if key in self._draining:
                self._draining.discard(key)
                c.draining.discard(id(have[key]))
        for r in info.retiring:
            key = (r.role, r.index)
            if key not in self._draining:
                self._draining.add(key)
                task = asyncio.ensure_future(c.drain(have[key]))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        if self.lease is not None:
            self.lease.handles = [b.handle for b in c.backends]
        if added and self.on_added is not None:
            self.on_added()


def model_info(model_dir: str, name: str) -> ModelInfo:
    cfg = ModelConfig.from_dir(model_dir)
    return ModelInfo(name=name, max_model_len=cfg.max_position_embeddings,
                     tokenizer=load_tokenizer(model_dir, cfg.vocab_size), chat_template=chat_template(model_dir),
                     vocab_size=cfg.vocab_size, eos_token_ids=cfg.eos_token_id)


def client_for(deployment, model_name: str, max_inflight: int = 1024, lease: GatewayLease | None = None,
               cache_route_margin: int | None = 4) -> EngineClient:
    """An engine client over `deployment`'s replicas (anything with `.replicas` and `.model_dir`);
    with `lease`, every stream it opens is held by that gateway lease."""
    gateway = lease.id if lease is not None else None
    backends = [RayBackend(r.coordinator, r.role, r.index, gateway=gateway) for r in deployment.replicas]
    return EngineClient(model_info(deployment.model_dir, model_name), backends, max_inflight=max_inflight,
                        cache_route_margin=cache_route_margin)
