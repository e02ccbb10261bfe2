"""An offer no other replica takes runs on where it was (DESIGN: "reclaimed by the source —
freed, or resumed locally if the client is still there").

A migration exports a running request and its gateway carries the offer to another replica.
When that replica turns it away (it refuses at admission, or the import fails there) and no
other replica can take it, or no replica is in service to take it at all, the request ended
with a 503 and the source freed the offer it still held. Now the gateway brings the offer back
to its source, which never let go of the state: the request runs on there and the client's
stream goes on as if it had never stopped (same tokens as an uninterrupted run), the admin's
migrate answers that it did not move (409 `taken_back`), and every pool is back at its baseline.

Real engine loops in process (LocalBackend), two colocated replicas, one engine client.
"""
from __future__ import annotations

import asyncio
import threading
import time

from fastapi.testclient import TestClient

from engine_helpers import HYBRID, assert_idle_clean, make_engine, tiny_model
from hyrax.actors.engine.commands import MigrateOut, Stats
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.loop import EngineLoop
from hyrax.api.app import GatewaySettings, create_app
from hyrax.api.client import EngineClient, LocalBackend, ModelInfo

MAX_TOKENS = 48
PROMPT = [5, 6, 7, 8, 9]
PARAMS = {"max_tokens": MAX_TOKENS, "ignore_eos": True, "temperature": 0.0}
INFO = ModelInfo("t", 4096, None, None, 96)


def _loops(target_config: dict | None = None) -> list[EngineLoop]:
    model = tiny_model(HYBRID)
    return [EngineLoop(make_engine(model, prefix_cache=False), "source"),
            EngineLoop(make_engine(model, prefix_cache=False, **(target_config or {})), "target")]


def _client(loops: list[EngineLoop]) -> EngineClient:
    return EngineClient(INFO, [LocalBackend(loop, "colocated", k) for k, loop in enumerate(loops)],
                        cache_route_margin=None)


class Stream:
    """One request streamed by `client` on an event loop of its own thread."""

    def __init__(self, client: EngineClient, rid: str, prompt: list[int] = PROMPT):
        self.client, self.rid, self.items, self.prompt = client, rid, [], prompt
        self.thread = threading.Thread(target=lambda: asyncio.run(self._consume()), daemon=True)
        self.thread.start()

    async def _consume(self):
        async for item in self.client.generate(self.rid, self.prompt, PARAMS):
            self.items.append(item)

    def tokens(self) -> list[int]:
        return [t for i in list(self.items) for t in i.get("token_ids") or []]

    def wait_tokens(self, n: int) -> None:
        deadline = time.monotonic() + 60
        while len(self.tokens()) < n:
            assert time.monotonic() < deadline, f"{self.rid}: {len(self.tokens())} tokens"
            time.sleep(0.002)

    def finish(self) -> list[int]:
        self.thread.join(120)
        assert not self.thread.is_alive(), f"{self.rid} never finished"
        assert self.items[-1]["finish_reason"] == "length" and not self.items[-1].get("error"), self.items[-1]
        return self.tokens()


def _uninterrupted(prompt: list[int] = PROMPT) -> list[int]:
    loops = _loops()
    try:
        s = Stream(_client(loops[:1]), "alone", prompt)
        return s.finish()
    finally:
        for loop in loops:
            loop.shutdown()


def _settled(loops: list[EngineLoop]) -> None:
    for loop in loops:
        deadline = time.monotonic() + 30
        while loop.engine.requests and time.monotonic() < deadline:
            time.sleep(0.01)
        with loop.lock:
            assert_idle_clean(loop.engine)


def _ran_on_at_the_source(loops: list[EngineLoop], streams: list[Stream], want: list[int]) -> None:
    """Every stream ended as the uninterrupted run, each request taken back by loops[0] and
    none left on loops[1]; both loops' pools back at their baseline."""
    assert [s.finish() for s in streams] == [want] * len(streams)
    assert loops[0].run(Stats())["offers_taken_back"] == len(streams)
    assert not loops[1].engine.requests
    _settled(loops)


def test_a_migration_the_target_refuses_runs_on_at_the_source_and_migrate_says_so():
    want = _uninterrupted()
    loops = _loops()
    client = _client(loops)
    app = create_app(client, GatewaySettings(admin_token="t"))
    app.state.ready = True
    try:
        s = Stream(client, "r1")
        s.wait_tokens(3)
        assert client.owner["r1"].index == 0
        loops[1].shutdown()  # colocated/1 refuses at admission; the gateway has not noticed yet
        with TestClient(app) as http:
            r = http.post("/admin/migrate", headers={"Authorization": "Bearer t"},
                          json={"request_id": "r1", "to": {"role": "colocated", "replica": 1}})
        assert r.status_code == 409, r.text
        error = r.json()["error"]
        assert error["code"] == "taken_back" and "runs on at colocated/0" in error["message"], error
        assert s.finish() == want  # as if it had never stopped
        assert loops[0].run(Stats())["offers_taken_back"] == 1
        _settled(loops[:1])
    finally:
        loops[0].shutdown()


def test_an_import_that_fails_at_the_target_runs_on_at_the_source():
    """colocated/1's pools could never hold the request: its import fails at admission (an
    error, not a refusal), so nothing of the request runs there."""
    want = _uninterrupted()
    loops = _loops(dict(kv_capacity_tokens=16))
    client = _client(loops)
    try:
        s = Stream(client, "r2")
        s.wait_tokens(16)  # 5 prompt tokens + 16: more than the target's 16 tokens of KV pool
        outcome, went = asyncio.run(client.migrate("r2", client.find_backend("colocated", 1)))
        assert outcome == Outcome.TAKEN_BACK and (went.role, went.index) == ("colocated", 0), (outcome, went)
        assert s.finish() == want
        assert loops[0].run(Stats())["offers_taken_back"] == 1
        assert loops[1].run(Stats())["transfers_in"] == {}
        _settled(loops)
    finally:
        for loop in loops:
            loop.shutdown()


def test_an_offer_with_nowhere_to_go_runs_on_at_the_source():
    """The only other replica went out of service (its health check failed) between the export
    and the hand-off reaching the gateway: nowhere to go."""
    want = _uninterrupted()
    loops = _loops()
    client = _client(loops)
    try:
        s = Stream(client, "r3")
        s.wait_tokens(3)
        client._refused(client.find_backend("colocated", 1), {"error": "its health check failed"})
        assert loops[0].run(MigrateOut("r3", ("colocated", 1)))
        _ran_on_at_the_source(loops, [s], want)
    finally:
        for loop in loops:
            loop.shutdown()


def test_a_hand_off_that_went_on_elsewhere_is_imported_not_taken_back():
    """The source still holds its offer (the importer's acknowledgement never reached it), but
    the request went on elsewhere and that replica was lost after streaming tokens: its gateway
    hands on the tokens alone. The source must not take back its stale offer (those tokens are
    past it): it frees the offer and rebuilds the request from the tokens, which then continues
    exactly as the uninterrupted run."""
    from engine_helpers import greedy
    from hyrax.actors.engine.local import run_to_completion

    model = tiny_model(HYBRID)
    alone = make_engine(model, prefix_cache=False)
    rid = alone.add_request(PROMPT, greedy(MAX_TOKENS, ignore_eos=True))
    run_to_completion(alone)
    want = alone.finished_requests[rid].output_ids

    e = make_engine(model, prefix_cache=False)
    rid = e.add_request(PROMPT, greedy(MAX_TOKENS, ignore_eos=True), "r5")
    while len(e.requests[rid].output_ids) < 5:
        e.step()
    e.sync()
    offer = e.export_running(rid)
    n = len(offer["request"]["output_ids"])
    lost = {"request": dict(offer["request"], output_ids=want[:n + 7]), "manifest": None, "payload": [],
            "lease_s": 0.0, "source": None}
    assert e.take_back(lost) is None and rid not in e.table.offered
    assert e.import_request(lost) == Outcome.RECOMPUTE
    run_to_completion(e)
    assert e.finished_requests[rid].output_ids == want
    assert e.stats.offers_reclaimed == 1 and e.stats.offers_taken_back == 0
    assert_idle_clean(e)


# ---- a prefill replica's hand-off that no decode replica takes --------------------------------
# DESIGN: an offer nobody acknowledges is "freed, or resumed locally if the client is still
# there". A prefill replica's offer was only ever freed (the client got a 503 after its first
# token), although the prefill replica holds the model and the request's state: it now runs the
# request on to its end itself, as a colocated replica would, and does not offer it again.

def _pd_loops(decode_config: dict | None = None) -> list[EngineLoop]:
    model = tiny_model(HYBRID)
    return [EngineLoop(make_engine(model, prefix_cache=True, role="prefill"), "prefill"),
            EngineLoop(make_engine(model, prefix_cache=False, role="decode", **(decode_config or {})), "decode")]


def _pd_client(loops: list[EngineLoop]) -> EngineClient:
    return EngineClient(INFO, [LocalBackend(loops[0], "prefill", 0), LocalBackend(loops[1], "decode", 0)],
                        cache_route_margin=None)


def test_a_hand_off_the_decode_replica_refuses_runs_on_at_the_prefill_replica():
    """decode/0 went down (it refuses at admission) before the gateway noticed: the prefill
    replica's offer has nowhere else to go."""
    want = _uninterrupted()
    loops = _pd_loops()
    loops[1].shutdown()
    client = _pd_client(loops)
    try:
        s = Stream(client, "p1")
        assert s.finish() == want  # one stream, as if it had been handed off
        stats = loops[0].run(Stats())
        assert stats["offers_taken_back"] == 1 and stats["transfers_out"] == 0, stats
        _settled(loops[:1])
    finally:
        loops[0].shutdown()


def test_a_hand_off_whose_import_fails_runs_on_at_the_prefill_replica():
    """decode/0's pools could never hold the request (its import fails there, an error): the
    prefill replica runs it on, and is not asked to offer it again after each token."""
    prompt = list(range(3, 23))  # 20 tokens and a first one: more than decode/0's 16 tokens of KV pool
    want = _uninterrupted(prompt)
    loops = _pd_loops(dict(kv_capacity_tokens=16))
    client = _pd_client(loops)
    try:
        _ran_on_at_the_source(loops, [Stream(client, f"p{k}", prompt) for k in range(2, 4)], want)
        assert loops[1].run(Stats())["transfers_in"] == {}
    finally:
        for loop in loops:
            loop.shutdown()


def test_a_hand_off_with_no_decode_replica_in_service_runs_on_at_the_prefill_replica():
    want = _uninterrupted()
    loops = _pd_loops()
    client = _pd_client(loops)
    client._refused(client.find_backend("decode", 0), {"error": "its health check failed"})
    try:
        _ran_on_at_the_source(loops, [Stream(client, "p4")], want)
    finally:
        for loop in loops:
            loop.shutdown()


def test_a_request_the_prefill_replica_took_back_moves_on_when_it_is_drained():
    """Taken back while no decode replica was in service; once one is back, draining the prefill
    replica moves the request there, and it still ends as the uninterrupted run."""
    want = _uninterrupted()
    loops = _pd_loops()
    client = _pd_client(loops)
    decode = client.find_backend("decode", 0)
    client._refused(decode, {"error": "its health check failed"})
    try:
        s = Stream(client, "p5")
        s.wait_tokens(3)
        assert client.owner["p5"].role == "prefill"
        client.out_of_service.pop(id(decode))  # its next health check found it well
        report = asyncio.run(client.drain(client.find_backend("prefill", 0)))
        assert report["migrations"]["p5"] == "migrating to decode/0", report
        assert s.finish() == want
        assert loops[1].run(Stats())["transfers_in"] == {"verified": 1}
        _settled(loops)
    finally:
        for loop in loops:
            loop.shutdown()
