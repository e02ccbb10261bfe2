"""The gateway's view of replica health: a replica that reports itself unhealthy or stuck, or
that misses health checks in a row, is taken out of routing — and the gateway stays ready as
long as some replica path can still serve a request. (A soak on a loaded 2-core machine saw
the whole gateway answer 503 "replicas are not ready" to 246 requests because one health
round over all replicas took longer than 5 s.)"""
from __future__ import annotations

import asyncio

from hyrax.api.client import EngineClient, ModelInfo


class FakeBackend:
    def __init__(self, role: str, index: int):
        self.role, self.index = role, index
        self.answer: dict | None = {"healthy": True, "stuck": None}  # None: never answers

    async def health(self) -> dict:
        if self.answer is None:
            await asyncio.sleep(3600)
        return {"role": self.role, "replica": self.index, **self.answer}


def _client(*roles: tuple[str, int]) -> tuple[EngineClient, list[FakeBackend]]:
    backends = [FakeBackend(r, i) for r, i in roles]
    info = ModelInfo("m", 16, None, None, 8)
    return EngineClient(info, backends, health_timeout_s=0.05, unresponsive_after=3), backends


def _health(client) -> dict:
    """The health round's operator view (detail): its reasons quote the replicas."""
    return asyncio.run(client.health()).detail()


def test_a_silent_decode_replica_leaves_routing_after_three_missed_checks_and_the_gateway_stays_ready():
    client, (prefill, d0, d1) = _client(("prefill", 0), ("decode", 0), ("decode", 1))
    d0.answer = None
    for _ in range(2):  # slow once or twice is not out
        h = _health(client)
        assert h["ready"] and h["reasons"] == [] and client._pick(("decode",)) is d0
    h = _health(client)
    assert h["ready"], h  # decode/1 still serves
    assert h["reasons"] == ["decode/0: unresponsive (3 health checks in a row unanswered within 0.05 s)"]
    assert client._pick(("decode",)) is d1 and client.unavailable() is None
    d0.answer = {"healthy": True, "stuck": None}  # answers again: back in service
    h = _health(client)
    assert h["ready"] and h["reasons"] == [] and client._pick(("decode",)) is d0


def test_a_replica_that_reports_itself_stuck_is_out_at_once_and_the_last_path_gone_is_not_ready():
    client, (only,) = _client(("colocated", 0))
    only.answer = {"healthy": True, "stuck": "work waiting, nothing running for 31 s"}
    h = _health(client)
    assert not h["ready"]
    assert h["reasons"][0] == "colocated/0: work waiting, nothing running for 31 s", h
    assert "out of service" in h["reasons"][1]
    assert h["replicas"][0]["state"] == "stuck" and not h["replicas"][0]["in_service"], h
    only.answer = {"healthy": True, "stuck": None}
    assert _health(client)["ready"]


def test_without_any_decode_replica_in_service_a_pd_gateway_is_not_ready():
    client, (_, d0) = _client(("prefill", 0), ("decode", 0))
    d0.answer = {"healthy": False, "stuck": None}
    h = _health(client)
    assert not h["ready"] and h["reasons"] == [
        "decode/0: unhealthy", "no decode replica accepts requests (all draining or out of service)"]


def test_an_unhealthy_replica_is_out_of_service_with_its_state_and_the_operator_sees_why_its_health_says():
    """The public reasons (GET /health, unauthenticated) name the state only; the replica's last
    error (exception text, pids) is in the detail (GET /admin/health): test_health_detail_hidden.py."""
    client, (only,) = _client(("colocated", 0))
    only.answer = {"healthy": False, "stuck": None,
                   "last_error": "ping failed on a rank: ActorDiedError: The actor died unexpectedly\n\tpid: 12"}
    report = asyncio.run(client.health())
    assert report.detail()["reasons"][0] == (
        "colocated/0: unhealthy (ping failed on a rank: ActorDiedError: The actor died unexpectedly)")
    assert report.public_reasons[0] == "colocated/0: unhealthy"
    only.answer = {"healthy": False, "down": True, "stuck": None,
                   "last_error": "replica down after 3 rank restarts within 600 s; failed 2 requests"}
    report = asyncio.run(client.health())
    assert report.detail()["reasons"][0] == (
        "colocated/0: down (replica down after 3 rank restarts within 600 s; failed 2 requests)")
    assert report.public_reasons[0] == "colocated/0: down"


def test_a_migration_target_must_decode_and_be_in_service():
    """An explicit migration target was never checked: a request moved to a prefill replica
    stalled there holding its state, one moved to a draining replica landed on a replica
    being emptied. Both are refused with the reason, and nothing is asked of the source."""
    client, (prefill, d0, d1) = _client(("prefill", 0), ("decode", 0), ("decode", 1))
    assert client.migration_refusal(d1) is None
    status, why = client.migration_refusal(prefill)
    assert status == 400 and "prefill/0 is a prefill replica" in why
    client.draining.add(id(d1))
    assert client.migration_refusal(d1) == (409, "decode/1 is draining or out of service")
    client.owner["r1"] = d0  # a running request; the source is never asked to export it
    for target in (prefill, d1):
        assert asyncio.run(client.migrate("r1", target))[0].ok is False


def test_a_stream_whose_replica_was_lost_says_so_when_no_other_replica_can_take_it():
    """A lost colocated replica's streams ended with "no decode replica accepts requests (all
    draining)": wrong on both counts (no decode role, nothing draining)."""
    client, (only,) = _client(("colocated", 0))

    def lost(request_id, prompt_ids, params):
        async def gen():
            yield {"token_ids": [5], "finished": False, "finish_reason": None}
            client.out_of_service[id(only)] = "unhealthy"  # what the health check makes of a replica that is gone
            yield {"token_ids": [], "finished": False, "finish_reason": None,
                   "handoff": {"request": {"id": request_id}, "manifest": None, "payload": [], "source": None}}
        return gen()
    only.generate = lost
    aborted = []

    async def run(cmd):
        aborted.append(cmd)
        return True
    only.run = run

    async def run_stream():
        items = [item async for item in client.generate("r1", [1, 2], {})]
        await asyncio.sleep(0)  # the abort sent on the way out
        return items
    items = asyncio.run(run_stream())
    last = items[-1]
    assert last["finish_reason"] == "error" and last["status"] == 503
    assert last["error"] == ("the replica serving this request (colocated/0) was lost, and no other decode or "
                             "colocated replica is in service to continue it"), last


def test_draining_the_last_replica_answers_at_once():
    """With nowhere to move its requests, a drain waited its whole 30 s for them to leave
    (an operator's curl -m 20 timed out with no answer). It answers at once: they stay."""
    import time

    from hyrax.actors.engine.commands import ListRequests, Load

    client, (only,) = _client(("colocated", 0))

    async def run(cmd):
        if isinstance(cmd, ListRequests):
            return [{"id": "r1", "state": "running"}]
        if isinstance(cmd, Load):
            return 1
        raise AssertionError(f"no other command expected, got {cmd}")
    only.run = run
    client.owner["r1"] = only
    t0 = time.monotonic()
    out = asyncio.run(client.drain(only, wait_s=5.0))
    assert time.monotonic() - t0 < 1.0, "the drain waited for requests that could not move"
    assert out == {"draining": "colocated/0", "migrations": {"r1": "no_other_replica"}, "remaining": 1}


def test_a_drain_waits_for_what_it_moved_not_for_a_held_request_that_stays():
    """A request retracted and held on the drained replica stays there until resumed; a drain
    that also moved a running request waited its whole 30 s (Load never reached 0) although the
    moved one had left at once."""
    import time

    from hyrax.actors.engine.commands import ListRequests, Load, MigrateOut

    client, (src, dst) = _client(("decode", 0), ("decode", 1))
    listed = {"r1": "running", "r2": "retracted"}
    polls = []

    async def run(cmd):
        if isinstance(cmd, MigrateOut):
            listed["r1"] = "offered"  # the importer takes it a few polls later
            return True
        if isinstance(cmd, ListRequests):
            polls.append(1)
            if listed.get("r1") == "offered" and len(polls) > 3:
                del listed["r1"]
            return [{"id": k, "state": v} for k, v in listed.items()]
        if isinstance(cmd, Load):
            return len(listed)
        raise AssertionError(f"no other command expected, got {cmd}")
    src.run = run

    async def dst_run(cmd):  # the drain's answer names where r1 went: decode/1 lists it once it took it
        assert isinstance(cmd, ListRequests), cmd
        return [] if "r1" in listed else [{"id": "r1", "state": "running", "hops": 1}]
    dst.run = dst_run
    client.owner.update(r1=src, r2=src)
    t0 = time.monotonic()
    out = asyncio.run(client.drain(src, wait_s=5.0))
    assert time.monotonic() - t0 < 2.0, "the drain waited for the held request, which does not move"
    assert out == {"draining": "decode/0", "migrations": {"r1": "migrating to decode/1"}, "remaining": 1}


def test_a_second_migration_of_a_request_on_its_way_leaves_the_first_ones_target():
    """A chaos run (drains and migrations from three operator threads) ended a stream with
    "no decode replica accepts requests": a drain had sent the request on its way to decode/0;
    a second migrate of it, refused by the replica (not running: already offered), then
    dropped the target the first one had chosen, so the hand-off looked for a replica anew
    and found both draining. The refused migration now leaves the first one's target alone."""
    from hyrax.actors.engine.commands import MigrateOut
    from hyrax.actors.engine.lifecycle import Outcome

    client, (d0, d1, d2) = _client(("decode", 0), ("decode", 1), ("decode", 2))
    exported = []

    async def run(cmd):
        assert isinstance(cmd, MigrateOut)
        exported.append(cmd.request_id)
        return len(exported) == 1  # the second export finds it offered, not running
    d1.run = run
    client.owner["r1"] = d1
    assert asyncio.run(client.migrate("r1", d0, wait_s=0)) == (Outcome.MIGRATING, d0)  # (these fakes list nothing)
    assert asyncio.run(client.migrate("r1", d2))[0] == Outcome.NOT_RUNNING
    assert client.migrate_to["r1"] is d0


def _handing_off(client, source, target_roles: str):
    """`source.generate` streams one token, then hands the request off (with state)."""
    def gen(request_id, prompt_ids, params):
        async def items():
            yield {"token_ids": [5], "finished": False, "finish_reason": None}
            yield {"token_ids": [], "finished": False, "finish_reason": None,
                   "handoff": {"request": {"id": request_id}, "manifest": {"m": 1}, "payload": [], "source": None}}
        return items()
    source.generate = gen


def test_a_hand_off_with_every_decode_replica_draining_goes_to_a_draining_one_rather_than_fail():
    """Draining stops new requests from being admitted; a request already streaming that must
    move (its prompt done on a prefill replica) went nowhere and ended with an error when every
    decode replica was draining. It continues on a draining replica in service instead; with
    none in service, the prefill replica takes its offer back and decodes it itself; only when
    that one went out of service too does it end, saying so."""
    client, (prefill, d0, d1) = _client(("prefill", 0), ("decode", 0), ("decode", 1))
    _handing_off(client, prefill, "decode")
    imported = []

    def take(handoff):
        async def items():  # as a replica's loop answers an import: acknowledged, then tokens
            imported.append(handoff["request"]["id"])
            yield {"token_ids": [], "finished": False, "finish_reason": None, "imported": "verified"}
            yield {"token_ids": [6], "finished": True, "finish_reason": "length"}
        return items()
    d1.generate_imported = take
    client.draining.update({id(d0), id(d1)})
    client.out_of_service[id(d0)] = "unhealthy"

    async def run_stream():
        return [item async for item in client.generate("r1", [1, 2], {})]
    items = asyncio.run(run_stream())
    assert imported == ["r1"] and items[-1]["finish_reason"] == "length", items
    client.out_of_service[id(d1)] = "unhealthy"
    prefill.generate_imported = take
    items = asyncio.run(run_stream())
    assert imported == ["r1", "r1"] and items[-1]["finish_reason"] == "length", items  # taken back

    async def aborts(cmd):
        return True
    prefill.run = aborts
    handing_off = prefill.generate

    def lost_meanwhile(request_id, prompt_ids, params):  # out of service by the time it hands off
        client.out_of_service[id(prefill)] = "unhealthy"
        return handing_off(request_id, prompt_ids, params)
    prefill.generate = lost_meanwhile
    last = asyncio.run(run_stream())[-1]
    assert last["finish_reason"] == "error" and last["status"] == 503
    assert last["error"] == "no decode replica is in service to continue this request", last
