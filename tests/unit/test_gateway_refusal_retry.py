"""A request a replica turned away before admitting it goes to another replica.

A replica that went down (its rank restarts used up) closes its loop and refuses every new
stream at once with one error item (503); the gateways stopped routing to it only at their next
health check, so meanwhile a request routed there got a 503 although another replica could serve
it. Now a refusal at admission (`step_feed.refusal_item`: nothing of the request ran there) takes
that replica out of service at once and the request goes to another one, each at most once; only
when none is left does the client get the 503 with Retry-After. A replica that failed after it
may have admitted the request (an error after a token, or an error that is not a refusal) is
never retried: the request could run twice, or its tokens reach the client twice."""
from __future__ import annotations

import asyncio
import json
import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest

from engine_helpers import HYBRID, make_engine, tiny_model
from gateway_fakes import Replica, gateway
from hyrax.actors.engine.commands import Abort
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.step_feed import error_item, is_refusal, refusal_item
from hyrax.api.client import EngineClient, LocalBackend, ModelInfo

DOWN = "the replica lost its ranks and could not restart them"  # what a closed loop refuses with


def _stream(items):
    async def gen():
        for item in items:
            await asyncio.sleep(0)
            yield dict(item)
    return gen()


def _tokens(text: str, finished: bool = True) -> dict:
    return {"token_ids": list(text.encode()), "finished": finished, "finish_reason": "length" if finished else None}


class Scripted(Replica):
    """A replica answering each stream with a script: `items(request id)` for a new request,
    `imported` for a hand-off it is offered. Records what it was asked."""

    def __init__(self, role: str, index: int, items=(), imported=()):
        self.role, self.index = role, index
        self.items, self.imported = items, imported
        self.calls, self.imports, self.commands = [], [], []

    def generate(self, request_id, prompt_ids, params):
        self.calls.append(request_id)
        return _stream(self.items(request_id) if callable(self.items) else self.items)

    def generate_imported(self, handoff):
        self.imports.append(handoff["request"]["id"])
        return _stream(self.imported)

    async def run(self, cmd):
        self.commands.append(cmd)
        return None  # a cached prefix of none; an abort taken


def refusing(role="colocated", index=0) -> Scripted:
    return Scripted(role, index, [refusal_item(DOWN)], [refusal_item(DOWN)])


def serving(text: str, role="colocated", index=1) -> Scripted:
    return Scripted(role, index, [_tokens(text[:1], False), _tokens(text[1:])])


def prefill(first: str, index=0) -> Scripted:
    """A prefill replica: the first token, then the request offered to a decode replica."""
    def items(rid):
        return [dict(_tokens(first, False), handoff={"request": {"id": rid, "output_ids": list(first.encode())},
                                                      "manifest": {}, "payload": [], "lease_s": 5.0,
                                                      "source": f"prefill/{index}"})]
    return Scripted("prefill", index, items)


def decode(rest: str, index: int) -> Scripted:
    return Scripted("decode", index, imported=[{"token_ids": [], "finished": False, "imported": "verified"},
                                               _tokens(rest)])


def _settled(client: EngineClient) -> None:
    """Nothing left counted: no choice admitted, no request owned or in flight anywhere."""
    assert client.admitted == 0, client.admitted
    assert not client.owner and all(v == 0 for v in client.inflight.values()), (client.owner, client.inflight)


def _e2e_count(http) -> float:
    return http.app.state.metrics.registry.get_sample_value("hyrax_e2e_request_latency_seconds_count") or 0


def _complete(http, n: int, stream: bool):
    """POST /v1/completions; (status, headers, {choice index: text}, finish reasons, error events)."""
    r = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4, "n": n, "stream": stream})
    if r.status_code != 200:  # streamed or not: a stream that never got under way is an error answer
        return r.status_code, r.headers, {}, {}, [r.json()]
    if not stream:
        body = r.json()
        return (r.status_code, r.headers, {c["index"]: c["text"] for c in body["choices"]},
                {c["index"]: c["finish_reason"] for c in body["choices"]}, [])
    texts, reasons, errors = {}, {}, []
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if "error" in event:
            errors.append(event)
            continue
        for c in event["choices"]:
            texts[c["index"]] = texts.get(c["index"], "") + c["text"]
            if c["finish_reason"]:
                reasons[c["index"]] = c["finish_reason"]
    return r.status_code, r.headers, texts, reasons, errors


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("n", [1, 2])
def test_a_request_a_closed_replica_refuses_is_served_by_the_other_and_the_refuser_leaves_service(stream, n):
    down, up = refusing(index=0), serving("ok", index=1)  # the refuser is the least loaded: picked first
    http = gateway(replicas=[down, up])
    client = http.app.state.client
    status, _, texts, reasons, errors = _complete(http, n, stream)
    assert status == 200 and not errors, errors
    assert texts == {k: "ok" for k in range(n)} and reasons == {k: "length" for k in range(n)}
    assert id(down) in client.out_of_service and id(up) not in client.out_of_service
    assert client._pick(("colocated",)) is up  # the next request goes straight to the other
    assert len(down.calls) == len(set(down.calls)) >= 1  # each choice asked it once at most
    assert len(up.calls) == len(set(up.calls)) == n  # each choice once
    assert not [c for c in down.commands if isinstance(c, Abort)]  # it holds nothing: nothing to free
    _settled(client)
    assert _e2e_count(http) == n  # one request each in the latency metrics, not one per try
    assert sum(client.route_stats.decisions.values()) == n  # one routing decision per choice
    assert client.route_stats.refusals["rerouted"] == len(down.calls)


def test_a_replica_taken_out_by_a_refusal_is_out_until_a_health_check_finds_it_healthy():
    down, up = refusing(index=0), serving("ok", index=1)
    http = gateway(replicas=[down, up])
    client = http.app.state.client
    assert _complete(http, 1, False)[0] == 200
    report = client.out_of_service[id(down)]
    assert not report.in_service and report.public_reason().startswith("colocated/0: "), report
    assert DOWN not in report.public_reason()  # the gateway's words, not the replica's
    assert report.answer["last_error"] == DOWN  # the operator's view quotes the replica
    asyncio.run(client.health())  # it answers healthy (the controller replaced what was behind it)
    assert id(down) not in client.out_of_service


@pytest.mark.parametrize("stream", [False, True])
def test_when_every_replica_refuses_the_client_gets_a_503_with_retry_after(stream):
    a, b = refusing(index=0), refusing(index=1)
    http = gateway(replicas=[a, b])
    client = http.app.state.client
    status, headers, texts, _, errors = _complete(http, 1, stream)
    # streamed too: no response had begun, so the answer is the 503 itself, not a 200 stream
    # holding an error event
    assert status == 503 and headers.get("Retry-After"), (status, headers)
    assert errors[0]["error"]["code"] == "unavailable"
    assert len(a.calls) == 1 and len(b.calls) == 1  # each asked once
    assert id(a) in client.out_of_service and id(b) in client.out_of_service
    assert client.route_stats.refusals == {"rerouted": 1, "answered": 1}
    _settled(client)
    # the next request is refused by the gateway itself, before any replica is asked
    r = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 4})
    assert r.status_code == 503 and r.headers.get("Retry-After") and len(a.calls) == len(b.calls) == 1
    _settled(client)


@pytest.mark.parametrize("script", [
    [_tokens("n", False), error_item(DOWN, 503)],  # a token, then the replica went down
    [error_item(DOWN, 503)],  # admitted, then ended as the replica went down: no token, yet it ran there
    [error_item("the replica serving this request failed", 503)],
], ids=["after-a-token", "admitted-no-token", "failed"])
def test_a_replica_that_fails_after_it_may_have_admitted_the_request_is_not_retried(script):
    failing, other = Scripted("colocated", 0, script), serving("ok", index=1)
    http = gateway(replicas=[failing, other])
    client = http.app.state.client
    status, _, texts, reasons, errors = _complete(http, 1, False)
    assert other.calls == [] and len(failing.calls) == 1
    assert id(failing) not in client.out_of_service  # the health check's call, as before
    assert "ok" not in texts.values()
    assert status == 503 or reasons == {0: "error"}, (status, reasons)
    assert client.route_stats.refusals == {}
    _settled(client)


def test_a_prefill_replica_that_refuses_sends_the_request_to_the_other_prefill_replica():
    p0, p1, d0 = refusing("prefill", 0), prefill("o", index=1), decode("k", index=0)
    http = gateway(replicas=[p0, p1, d0])
    client = http.app.state.client
    status, _, texts, reasons, errors = _complete(http, 1, True)
    assert status == 200 and not errors and texts == {0: "ok"} and reasons == {0: "length"}, (texts, errors)
    assert len(p0.calls) == 1 and p1.calls == p0.calls and d0.imports == p0.calls
    assert id(p0) in client.out_of_service
    _settled(client)


def test_a_decode_replica_that_refuses_the_handoff_passes_it_to_the_other_decode_replica():
    """The refuser never imported it, so the source still offers its state: the next decode
    replica imports the same hand-off and acknowledges it; the first token is streamed once."""
    p0, d0, d1 = prefill("o"), refusing("decode", 0), decode("k", index=1)
    http = gateway(replicas=[p0, d0, d1])
    client = http.app.state.client
    status, _, texts, reasons, errors = _complete(http, 1, False)
    assert status == 200 and texts == {0: "ok"} and reasons == {0: "length"}, (status, texts, errors)
    assert d0.imports == p0.calls and d1.imports == p0.calls
    assert id(d0) in client.out_of_service and id(p0) not in client.out_of_service
    assert not [c for c in p0.commands if isinstance(c, Abort)]  # d1 took the offer: nothing to free
    assert client.route_stats.refusals == {"rerouted": 1}
    _settled(client)


def test_when_every_decode_replica_refuses_the_handoff_the_prefill_replica_takes_it_back_and_runs_it_on():
    """Each decode replica is tried once; then the offer goes back to the prefill replica that
    made it (it holds the state: DESIGN's "resumed locally"), whose stream goes on where the
    first token left off, instead of a 503 that threw the prefilled request away."""
    p0, d0, d1 = prefill("o"), refusing("decode", 0), refusing("decode", 1)
    # what the prefill replica streams once it took its offer back (its loop's answer: taken back, then tokens)
    p0.imported = [{"token_ids": [], "finished": False, "finish_reason": None, "imported": "taken_back"},
                   _tokens("k")]
    http = gateway(replicas=[p0, d0, d1])
    client = http.app.state.client
    status, _, texts, reasons, errors = _complete(http, 1, True)
    assert texts == {0: "ok"} and reasons == {0: "length"} and not errors, (texts, reasons, errors)
    assert len(d0.imports) == len(d1.imports) == 1 and p0.imports == p0.calls
    assert not [c for c in p0.commands if isinstance(c, Abort)]  # nothing to free: it runs there
    _settled(client)


def test_a_real_closed_loop_refusal_is_rerouted():
    """The loop's own refusal (EngineLoop.close, as the coordinator's down path calls it) is one
    the gateway recognises: not a fake's item."""
    loop = EngineLoop(make_engine(tiny_model(HYBRID), prefix_cache=False), "closed")
    try:
        with loop.lock:
            loop.close(DOWN)
        closed, up = LocalBackend(loop, "colocated", 0), serving("ok", index=1)
        client = EngineClient(ModelInfo("m", 4096, None, None, 96), [closed, up])

        async def consume():
            return [item async for item in client.generate("r1", [5, 6, 7], {"max_tokens": 4})]

        items = asyncio.run(consume())
        assert [t for item in items for t in item["token_ids"]] == list(b"ok") and items[-1]["finished"]
        assert not any(item.get("error") for item in items), items
        assert id(closed) in client.out_of_service and up.calls == ["r1"]
        _settled(client)
    finally:
        loop.shutdown()


# ---- over Ray: a replica whose actor is gone when the request is submitted -----------------------

class _Remote:
    def __init__(self, fn):
        self.remote = fn


class _GoneActor:
    """A coordinator handle whose calls all fail with `error`, as Ray answers for an actor gone."""

    def __init__(self, error: Exception):
        async def fail(*args, **kw):
            raise error

        async def feed(*args, **kw):
            raise error
            yield  # an async generator

        self.submit = self.submit_imported = self.run = self.close_feed = _Remote(fail)
        self.feed = _Remote(feed)


def _follow(error: Exception) -> list[dict]:
    from hyrax.cluster.ray_client import RayBackend

    backend = RayBackend(_GoneActor(error), "colocated", 0, gateway="g")

    async def consume():
        return [item async for item in backend.generate("r1", [1, 2], {"max_tokens": 4})]
    return asyncio.run(consume())


def test_a_replica_whose_actor_died_refuses_the_request_it_is_sent():
    """A coordinator has no restarts (max_restarts=0): one Ray reports died holds nothing any more,
    whatever the call reached, and nothing it sent for the request is passed on."""
    import ray.exceptions

    [item] = _follow(ray.exceptions.ActorDiedError())
    assert is_refusal(item) and item["status"] == 503, item


def test_a_replica_whose_actor_is_unavailable_is_no_refusal():
    """Ray's ActorUnavailableError says the call may or may not have run there: not a refusal (the
    request goes on as a replica lost mid-stream does: a hand-off without state)."""
    import ray.exceptions

    items = _follow(ray.exceptions.ActorUnavailableError("unreachable", None))
    assert not any(is_refusal(i) for i in items) and "handoff" in items[-1], items


def test_a_request_aborted_while_a_replica_refuses_it_ends_aborted_and_goes_nowhere_else():
    """The abort went to the owner of the moment, the refuser, which held nothing: sent on, the
    request would run elsewhere although its client had ended it."""
    up = serving("ok", index=1)
    client = EngineClient(ModelInfo("m", 4096, None, None, 96), [], cache_route_margin=None)

    class AbortedMeanwhile(Scripted):
        def generate(self, request_id, prompt_ids, params):
            async def gen():
                assert await client.abort(request_id)  # it owns the request now
                yield refusal_item(DOWN)
            return gen()

    down = AbortedMeanwhile("colocated", 0)
    client.backends = [down, up]

    async def consume():
        return [item async for item in client.generate("r1", [5, 6], {"max_tokens": 4})]

    assert asyncio.run(consume()) == [{"token_ids": [], "finished": True, "finish_reason": "abort"}]
    assert up.calls == [] and id(down) in client.out_of_service
    _settled(client)


def test_a_replica_that_was_only_unavailable_is_told_to_drop_the_request_that_goes_elsewhere():
    """An actor Ray finds unavailable may be alive and may have admitted the request: the request
    goes on elsewhere (a hand-off without state), so the first replica must be told to end its
    copy (an abort, sent whenever it can be reached; one that arrives before the submit is kept as
    an early abort), or two replicas would own it and the first would run it to its end."""
    import ray.exceptions

    from hyrax.actors.engine.commands import Abort
    from hyrax.cluster.ray_client import RayBackend

    sent = []
    handle = _GoneActor(ray.exceptions.ActorUnavailableError("unreachable", None))

    async def run(cmd, *args, **kw):
        sent.append(cmd)
    handle.run = _Remote(run)
    backend = RayBackend(handle, "colocated", 0, gateway="g")

    async def consume():
        items = [item async for item in backend.generate("r1", [1, 2], {"max_tokens": 4})]
        await asyncio.sleep(0)  # a fire-and-forget call gets its turn
        return items
    items = asyncio.run(consume())
    assert "handoff" in items[-1], items
    assert [c for c in sent if isinstance(c, Abort) and c.request_id == "r1"], sent


def test_a_refused_stream_is_closed_before_the_next_replica_is_asked():
    """The stream a refusal ends is left with a `break`: closed there and then (its `finally`, which
    on a Ray replica lets go of the request's queue in the feed), not whenever the collector gets
    to it, after the request already went on to the next replica."""
    events = []

    class Refuses(Scripted):
        def generate(self, request_id, prompt_ids, params):
            async def gen():
                try:
                    yield refusal_item(DOWN)
                finally:
                    events.append("refused stream closed")
            return gen()

    class Records(Scripted):
        def generate(self, request_id, prompt_ids, params):
            events.append("next replica asked")
            return super().generate(request_id, prompt_ids, params)

    up = Records("colocated", 1, [_tokens("o", False), _tokens("k")])
    client = EngineClient(ModelInfo("m", 4096, None, None, 96), [Refuses("colocated", 0), up],
                          cache_route_margin=None)

    async def consume():
        return [item async for item in client.generate("r1", [5, 6], {"max_tokens": 4})]
    asyncio.run(consume())
    assert events == ["refused stream closed", "next replica asked"], events


def test_an_unseeded_request_sent_over_ray_samples_with_the_seed_its_hand_off_carries():
    """The gateway keeps each request's tokens and seed, and a replica lost mid-stream is left by a
    hand-off carrying them: the next replica rebuilds the state and samples on with that seed. It
    must be the seed the first replica sampled with: the gateway drew one for a request without a
    seed but sent the request without it, so the replica drew another, and the continuation after
    a loss drew from a stream the request had never used."""
    import ray.exceptions

    from hyrax.cluster.ray_client import RayBackend

    submitted = []
    handle = _GoneActor(ray.exceptions.ActorUnavailableError("unreachable", None))

    async def submit(feed_id, request_id, prompt_ids, params, **kw):
        submitted.append(params)
        raise ray.exceptions.ActorUnavailableError("unreachable", None)
    handle.submit = _Remote(submit)
    backend = RayBackend(handle, "colocated", 0, gateway="g")

    async def consume():
        return [item async for item in backend.generate("r1", [1, 2], {"max_tokens": 4, "temperature": 1.0})]
    items = asyncio.run(consume())
    handoff = items[-1]["handoff"]
    [params] = submitted
    assert isinstance(handoff["request"]["seed"], int)
    assert params["seed"] == handoff["request"]["seed"] == handoff["request"]["params"].seed
