"""`POST /admin/migrate` with several gateways on one deployment, and what its answer names.

A request is streamed by one gateway; any gateway lists it (/admin/requests). Migrating it from
another gateway answered 'unknown request' (404): the hand-off reaches the gateway that streams
the request, which knew nothing of the target. Now the target travels with the hand-off.
The answer named the target asked for even when that replica refused the hand-off and the
request went on elsewhere; now it names the replica that took the request over.

Real engine loops in process (LocalBackend), two or three replicas, one or two engine clients.
"""
from __future__ import annotations

import asyncio
import threading
import time

from fastapi.testclient import TestClient

from engine_helpers import HYBRID, make_engine, tiny_model
from hyrax.actors.engine.commands import ListRequests, Stats
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.api.app import GatewaySettings, create_app
from hyrax.api.client import EngineClient, LocalBackend, ModelInfo

MAX_TOKENS = 60
INFO = ModelInfo("t", 4096, None, None, 96)


def _loops(n: int) -> list[EngineLoop]:
    model = tiny_model(HYBRID)
    return [EngineLoop(make_engine(model, deterministic=False, prefix_cache=False), f"g{k}") for k in range(n)]


def _gateway(loops: list[EngineLoop]) -> EngineClient:
    """A gateway's engine client over `loops` (colocated/0, /1, ...): its own backends, as each
    gateway process has its own handles on the same replicas."""
    return EngineClient(INFO, [LocalBackend(loop, "colocated", k) for k, loop in enumerate(loops)],
                        cache_route_margin=None)


class Stream:
    """One request streamed by `client` on an event loop of its own thread (another gateway's
    process, as far as the other client can tell)."""

    def __init__(self, client: EngineClient, rid: str):
        self.client, self.rid, self.items = client, rid, []
        self.thread = threading.Thread(target=lambda: asyncio.run(self._consume()), daemon=True)
        self.thread.start()

    async def _consume(self):
        async for item in self.client.generate(self.rid, [5, 6, 7, 8], {"max_tokens": MAX_TOKENS,
                                                                         "ignore_eos": True}):
            self.items.append(item)

    def tokens(self) -> int:
        return sum(len(i.get("token_ids") or []) for i in list(self.items))

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while self.tokens() < n:
            assert time.monotonic() < deadline, f"{self.rid}: {self.tokens()} tokens"
            time.sleep(0.005)

    def finish(self) -> None:
        self.thread.join(120)
        assert not self.thread.is_alive(), f"{self.rid} never finished"
        assert self.items[-1]["finish_reason"] == "length", self.items[-1]
        assert self.tokens() == MAX_TOKENS


def _transfers_in(loop: EngineLoop) -> dict:
    return dict(loop.run(Stats())["transfers_in"])


def test_a_gateway_migrates_a_request_another_gateway_streams():
    loops = _loops(2)
    streamer, other = _gateway(loops), _gateway(loops)
    app = create_app(other, GatewaySettings(admin_token="t"))
    app.state.ready = True
    try:
        s = Stream(streamer, "r1")  # routed to colocated/0 (least loaded, lowest index)
        s.wait_tokens(3)
        assert streamer.owner["r1"].index == 0
        with TestClient(app) as http:
            r = http.post("/admin/migrate", headers={"Authorization": "Bearer t"},
                          json={"request_id": "r1", "to": {"role": "colocated", "replica": 1}})
        assert r.status_code == 200, r.text
        assert r.json() == {"request_id": "r1", "result": "migrating to colocated/1"}
        s.finish()
        assert _transfers_in(loops[1]) == {"verified": 1}
        assert "r1" not in streamer.owner and not streamer.migrate_to
    finally:
        for loop in loops:
            loop.shutdown()


def test_the_migrate_answer_names_the_replica_that_took_the_request_after_the_target_refused():
    """colocated/1 refuses every request at admission (its loop shut down) before this gateway
    has found out: the hand-off goes on to colocated/2, and that is where the request went."""
    loops = _loops(3)
    client = _gateway(loops)
    try:
        s = Stream(client, "r2")
        s.wait_tokens(3)
        assert client.owner["r2"].index == 0
        loops[1].shutdown()
        target = client.find_backend("colocated", 1)
        outcome, went = asyncio.run(client.migrate("r2", target))
        assert outcome == Outcome.MIGRATING
        assert (went.role, went.index) == ("colocated", 2), f"answered {went.role}/{went.index}"
        s.finish()
        assert _transfers_in(loops[2]) == {"verified": 1}
    finally:
        for loop in (loops[0], loops[2]):
            loop.shutdown()


def test_a_gateway_drains_a_replica_of_the_requests_another_gateway_streams():
    """An operator's drain through one gateway moved only the requests that gateway streamed
    itself: another gateway's request stayed on the draining replica (`remaining` 1)."""
    loops = _loops(2)
    streamer, admin = _gateway(loops), _gateway(loops)
    try:
        s = Stream(streamer, "r3")
        s.wait_tokens(3)
        assert streamer.owner["r3"].index == 0
        out = asyncio.run(admin.drain(admin.find_backend("colocated", 0)))
        assert out["migrations"] == {"r3": "migrating to colocated/1"}, out
        assert out["remaining"] == 0, out
        s.finish()
        assert _transfers_in(loops[1]) == {"verified": 1}
    finally:
        for loop in loops:
            loop.shutdown()


class ListsFirst(LocalBackend):
    """A replica as one gateway sees it, whose listing answers before `meanwhile` (another
    gateway's drain of it, on an event loop of its own) runs; then this gateway goes on."""

    def __init__(self, loop, index: int, meanwhile):
        super().__init__(loop, "colocated", index)
        self.meanwhile = meanwhile

    async def run(self, cmd):
        out = await super().run(cmd)
        if isinstance(cmd, ListRequests) and self.meanwhile is not None:
            meanwhile, self.meanwhile = self.meanwhile, None
            await asyncio.to_thread(meanwhile)
        return out


def test_two_gateways_draining_one_replica_move_each_request_once():
    """Scale-down drains a retiring replica through every gateway's membership task. A drain
    whose listing came before another gateway's drain moved a request moved that request again,
    from the replica it had just arrived on (migrations {'r4': 'migrating to colocated/2'}, two
    imports)."""
    loops = _loops(3)
    streamer, first, second = _gateway(loops), _gateway(loops), _gateway(loops)
    try:
        s = Stream(streamer, "r4")
        s.wait_tokens(3)
        assert streamer.owner["r4"].index == 0
        first_out = {}

        def first_drains():
            first_out.update(asyncio.run(first.drain(first.find_backend("colocated", 0))))
        second.backends[0] = ListsFirst(loops[0], 0, first_drains)
        out = asyncio.run(second.drain(second.backends[0]))
        assert first_out["migrations"] == {"r4": "migrating to colocated/1"}, first_out
        assert out["migrations"] == {"r4": Outcome.NOT_RUNNING.value}, out
        assert out["remaining"] == 0, out
        s.finish()
        assert [_transfers_in(loop) for loop in loops] == [{}, {"verified": 1}, {}]
    finally:
        for loop in loops:
            loop.shutdown()
