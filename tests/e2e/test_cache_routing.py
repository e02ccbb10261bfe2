"""Cache-aware routing over two prefill replicas (in-process engines, one decode replica): a
request goes to the prefill replica that has its prefix cached even when the least-loaded
rule would pick the other one, unless that replica is busier than the margin allows; with
routing by load alone the same workload hits far less."""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import random

from e2e_harness import DEMO_MODEL, E2E_CONFIG, MODEL
from hyrax.actors.engine.local import load_engine
from hyrax.actors.engine.loop import EngineLoop
from hyrax.api.client import EngineClient, LocalBackend
from hyrax.cluster.ray_client import model_info

PARAMS = {"max_tokens": 3, "temperature": 0.0}


@contextlib.contextmanager
def two_prefill_replicas(margin):
    info = model_info(DEMO_MODEL, MODEL)
    loops = []
    try:
        for role in ("prefill", "prefill", "decode"):
            engine = load_engine(DEMO_MODEL, dataclasses.replace(E2E_CONFIG, role=role), decode=info.tokenizer.decode)
            loops.append(EngineLoop(engine, f"route-{role}-{len(loops)}"))
        backends = [LocalBackend(loops[0], "prefill", 0), LocalBackend(loops[1], "prefill", 1),
                    LocalBackend(loops[2], "decode", 0)]
        yield EngineClient(info, backends, cache_route_margin=margin), loops
    finally:
        for lp in loops:
            lp.shutdown()


async def _run(client, rid: str, prompt: list[int]) -> list[int]:
    out = []
    async for item in client.generate(rid, prompt, dict(PARAMS)):
        assert "error" not in item, item
        out += item.get("token_ids", [])
    return out


def _prefixes(n: int) -> list[list[int]]:
    rng = random.Random(11)
    return [[rng.randrange(3, 250) for _ in range(160)] for _ in range(n)]


async def _workload(client, prefixes: list[list[int]]) -> list[list[int]]:
    """Warm-up: every prefix group's first request, two at a time (so both replicas get some);
    then three more requests per group, one after another (the least-loaded rule sends each to
    replica 0: nothing else is in flight)."""
    rng = random.Random(12)
    outs = []
    for k in range(0, len(prefixes), 2):
        outs += await asyncio.gather(*(_run(client, f"warm-{k + j}", p + [rng.randrange(3, 250)])
                                       for j, p in enumerate(prefixes[k:k + 2])))
    for r in range(3):
        for g, p in enumerate(prefixes):
            outs.append(await _run(client, f"g{g}-{r}", p + [rng.randrange(3, 250) for _ in range(5)]))
    return outs


def _hits(loops) -> list[int]:
    return [lp.engine.stats.prefix.hit_tokens for lp in loops[:2]]


def test_cache_aware_routing_follows_the_cached_prefix_and_beats_least_loaded():
    prefixes = _prefixes(8)
    with two_prefill_replicas(margin=4) as (client, loops):
        aware = asyncio.run(_workload(client, prefixes))
        aware_hits = _hits(loops)
        decisions = dict(client.route_stats.decisions)
    with two_prefill_replicas(margin=None) as (client, loops):
        plain = asyncio.run(_workload(client, prefixes))
        plain_hits = _hits(loops)
        assert not client.route_stats.decisions  # load only: the replicas are never asked
    assert aware == plain  # where a prompt ran changes nothing but the work (deterministic mode)
    assert min(aware_hits) > 0, aware_hits  # both replicas served hits: requests followed their prefix
    assert decisions.get("cache", 0) >= 3 * len(prefixes), decisions
    assert sum(aware_hits) > sum(plain_hits), (aware_hits, plain_hits)


def test_a_replica_with_the_prefix_but_too_busy_loses_to_the_least_loaded():
    prefixes = _prefixes(1)

    async def scenario(client, loops):
        await _run(client, "warm", prefixes[0] + [5])  # cached on replica 0 (least loaded, index 0)
        client.inflight[id(client.backends[0])] = 3  # replica 0 is busy beyond the margin of 1
        await _run(client, "busy", prefixes[0] + [6, 7])
        client.inflight[id(client.backends[0])] = 0

    with two_prefill_replicas(margin=1) as (client, loops):
        asyncio.run(scenario(client, loops))
        assert client.route_stats.decisions["margin"] == 1
        assert loops[1].engine.stats.prompt_tokens > 0  # it ran on replica 1
