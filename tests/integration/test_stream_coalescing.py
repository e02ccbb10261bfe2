"""The replica -> gateway stream carries one message per engine step, not one per token per
request (issue 21): the gateway's engine client over a real replica, with the coordinator's
handle wrapped only to count the messages its streaming calls deliver. Every stream still gets
exactly its tokens in order, its finish reason and its logprobs; a gateway whose lease runs out
still has its streams on that feed aborted."""
from __future__ import annotations

import asyncio
import ray

from ray_harness import DEMO_CONFIG, DEMO_MODEL, PARAMS, assert_clean, call, prompt, reference, replica, uid

from hyrax.api.client import EngineClient, ModelInfo
from hyrax.cluster.ray_client import GatewayLease, RayBackend

REQUESTS, MAX_TOKENS = 8, 24
# the lost-replica test: its replica is killed once every request has 5 tokens; the rest (the
# survivor's recompute and decode) need only outlast the kill, and the test fails loudly (3
# recomputes asserted) if one finished before it
LOST_TOKENS = 64


class CountingHandle:
    """The coordinator's own actor handle; counts the messages (object refs) that its streaming
    calls yield to this process. Calls go through unchanged."""

    def __init__(self, handle):
        self._handle, self.messages = handle, 0

    def __getattr__(self, name):
        return _CountingMethod(getattr(self._handle, name), self)


class _CountingMethod:
    def __init__(self, method, owner: CountingHandle):
        self._method, self._owner = method, owner

    def remote(self, *args, **kwargs):
        out = self._method.remote(*args, **kwargs)
        return _CountingStream(out, self._owner) if isinstance(out, ray.ObjectRefGenerator) else out


class _CountingStream:
    def __init__(self, gen, owner: CountingHandle):
        self._gen, self._owner = gen, owner

    def __aiter__(self):
        return self

    async def __anext__(self):
        ref = await self._gen.__anext__()
        self._owner.messages += 1
        return ref


def _client(backend) -> EngineClient:
    return EngineClient(ModelInfo("coalescing", 4096, None, None, 256), [backend])


async def _collect(client: EngineClient, rid: str, ids: list[int], params: dict) -> dict:
    out = {"tokens": [], "logprobs": [], "finish_reason": None, "items": 0}
    async for item in client.generate(rid, ids, params):
        out["items"] += 1
        out["tokens"] += item.get("token_ids") or []
        out["logprobs"] += item.get("logprobs") or []
        if item.get("finished"):
            out["finish_reason"] = item.get("finish_reason")
            out["error"] = item.get("error")
    return out


def test_a_replica_sends_its_gateway_one_message_per_step_not_one_per_token(demo_deployment):
    coord = replica(demo_deployment, "tp1").coordinator
    prompts = [prompt(10 + 3 * i, seed=40 + i) for i in range(REQUESTS)]
    want = reference(DEMO_MODEL, DEMO_CONFIG, prompts, MAX_TOKENS)
    handle = CountingHandle(coord)
    client = _client(RayBackend(handle, "colocated", 0))
    steps_before = call(coord.stats)["steps"]

    async def run():
        params = {"max_tokens": MAX_TOKENS, "logprobs": 2, **PARAMS}
        return await asyncio.gather(*(_collect(client, uid(f"co{i}"), p, params) for i, p in enumerate(prompts)))

    got = asyncio.run(run())
    steps = call(coord.stats)["steps"] - steps_before
    assert [g["tokens"] for g in got] == want
    assert [g["finish_reason"] for g in got] == ["length"] * REQUESTS
    assert all(len(g["logprobs"]) == MAX_TOKENS for g in got)
    tokens = REQUESTS * MAX_TOKENS
    # one per token per request would be >= 192 here; one per step is at most `steps` (~30)
    assert 0 < handle.messages <= steps < tokens / 4, (handle.messages, steps, tokens)
    assert_clean(coord)


def test_a_silent_gateways_requests_on_its_feed_are_aborted_and_another_gateways_are_not(demo_deployment):
    coord = replica(demo_deployment, "tp1").coordinator
    alive, dead = GatewayLease([coord], lease_s=1.0).start(), GatewayLease([coord], lease_s=1.0).start()
    dead.stop()  # renewed once, never again: as if its process were gone

    async def run():
        return await asyncio.gather(
            _collect(_client(RayBackend(coord, "colocated", 0, gateway=dead.id)), uid("orphan"), prompt(12, 1),
                     {"max_tokens": 1500, **PARAMS}),
            _collect(_client(RayBackend(coord, "colocated", 0, gateway=alive.id)), uid("kept"), prompt(12, 2),
                     {"max_tokens": 300, **PARAMS}))
    try:
        orphan, kept = asyncio.run(asyncio.wait_for(run(), 120))
    finally:
        alive.stop()
    assert orphan["finish_reason"] == "abort" and len(orphan["tokens"]) < 1500
    assert "stopped renewing its lease" in orphan["error"], orphan["error"]  # it says why, should anyone read it
    assert kept["finish_reason"] == "length" and len(kept["tokens"]) == 300
    assert_clean(coord)


def test_a_replica_lost_mid_stream_hands_every_request_on_its_feed_to_another_replica(demo_deployment):
    """Three requests share one feed from a replica that is killed mid-stream: each ends its
    stream there with a stateless hand-off and continues on the other replica by recompute, with
    exactly the tokens of an uninterrupted run."""
    from hyrax.cluster.deployment import RoleSpec
    from ray_harness import deployed

    survivor = replica(demo_deployment, "tp1").coordinator
    prompts = [prompt(14 + i, seed=70 + i) for i in range(3)]
    want = reference(DEMO_MODEL, DEMO_CONFIG, prompts, LOST_TOKENS)
    recomputed_before = call(survivor.stats)["transfers_in"].get("recompute", 0)
    with deployed(DEMO_MODEL, [RoleSpec("lossy", 1, 1)], DEMO_CONFIG) as d:
        doomed = replica(d, "lossy").coordinator
        lost, kept = RayBackend(doomed, "decode", 0), RayBackend(survivor, "decode", 1)
        client = EngineClient(ModelInfo("coalescing", 4096, None, None, 256), [lost, kept])
        client.draining.add(id(kept))  # every request starts on the doomed replica

        async def run():
            got = [{"tokens": []} for _ in prompts]

            async def one(i):
                async for item in client.generate(uid(f"lost{i}"), prompts[i], {"max_tokens": LOST_TOKENS, **PARAMS}):
                    got[i]["tokens"] += item.get("token_ids") or []
                    got[i]["finish_reason"] = item.get("finish_reason")
            tasks = [asyncio.ensure_future(one(i)) for i in range(3)]
            while min(len(g["tokens"]) for g in got) < 5:
                await asyncio.sleep(0.01)
            client.draining.discard(id(kept))
            ray.kill(doomed, no_restart=True)
            await asyncio.wait_for(asyncio.gather(*tasks), 120)
            return got
        got = asyncio.run(run())
    assert [g["tokens"] for g in got] == want
    assert [g["finish_reason"] for g in got] == ["length"] * 3
    assert call(survivor.stats)["transfers_in"].get("recompute", 0) - recomputed_before == 3
    assert_clean(survivor)


STALL_S = 4.0  # the gateway's event loop does nothing for this long: its feed is not read


def test_a_gateway_that_stops_reading_gets_a_bounded_feed_and_then_every_token_in_order(demo_deployment):
    """A gateway whose event loop is held up (a long call on it, a frozen process) reads nothing of
    its feed. Ray sent the replica's batches on regardless, one message a step, for as long as the
    gateway lagged: Ray held them all for it. Now at most IN_FLIGHT messages are on their way and
    the replica holds the rest in the feed's queue, at most FOLD_AFTER batches, folded per request;
    once the gateway reads again it gets every token and logprob in order, in far fewer messages
    than the steps it missed."""
    import time

    from hyrax.actors.engine.feed_queue import FOLD_AFTER, IN_FLIGHT

    coord = replica(demo_deployment, "tp1").coordinator
    prompts = [prompt(12 + 5 * i, seed=90 + i) for i in range(3)]
    max_tokens = 400
    want = reference(DEMO_MODEL, DEMO_CONFIG, prompts, max_tokens)
    handle = CountingHandle(coord)
    client = _client(RayBackend(handle, "colocated", 0))
    seen: dict = {}

    async def run():
        params = {"max_tokens": max_tokens, "logprobs": 1, **PARAMS}
        outs = [{"tokens": []} for _ in prompts]

        async def one(i):
            outs[i] = await _collect(client, uid(f"stall{i}"), prompts[i], params)
        tasks = [asyncio.ensure_future(one(i)) for i in range(len(prompts))]
        while handle.messages < 3:
            await asyncio.sleep(0.01)
        seen["messages"], seen["steps"] = handle.messages, (await coord.stats.remote())["steps"]
        time.sleep(STALL_S)  # this gateway's event loop is held up: its feed is not read
        seen["stalled_steps"] = ray.get(coord.stats.remote())["steps"] - seen["steps"]
        seen["feeds"] = ray.get(coord.health.remote())["feeds"]
        await asyncio.wait_for(asyncio.gather(*tasks), 120)
        seen["steps_after"] = (await coord.stats.remote())["steps"] - seen["steps"]
        return outs

    got = asyncio.run(run())
    assert [g["tokens"] for g in got] == want
    assert [g["finish_reason"] for g in got] == ["length"] * len(prompts)
    assert all(len(g["logprobs"]) == max_tokens for g in got)
    stalled, feeds = seen["stalled_steps"], seen["feeds"]
    assert stalled > 2 * FOLD_AFTER, f"only {stalled} steps while the gateway stalled: nothing to bound"
    assert feeds["batches_held"] <= FOLD_AFTER and feeds["folds"] >= 1, feeds
    messages = handle.messages - seen["messages"]
    # one message a step would be `steps_after`; the stall's steps came in at most about IN_FLIGHT + 2
    assert messages <= seen["steps_after"] - stalled + IN_FLIGHT + 4, (messages, seen, feeds)
    assert_clean(coord)
