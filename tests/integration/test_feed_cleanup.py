"""A consumer that goes away leaves no feed behind on the replica: neither its entry nor the
streaming generator that waited on it (hyrax/actors/engine/feed_registry.py). Before, every
engine client's event loop that ever streamed from a replica left one of each for the
replica's life, and a gateway whose lease lapsed left its feed's generator waiting forever."""
from __future__ import annotations

import asyncio
import time

import ray

from hyrax.cluster.ray_client import RayBackend
from ray_harness import prompt, replica, uid


def _feeds(coord) -> tuple[int, int]:
    """(feed entries, live `feed` generator frames) on the replica."""
    def probe(self):
        import gc
        import types

        gens = [o for o in gc.get_objects() if isinstance(o, types.AsyncGeneratorType)
                and o.ag_code.co_name == "feed" and o.ag_frame is not None]
        return len(self.feeds), len(gens)
    return ray.get(coord.__ray_call__.remote(probe))


def _settles_at(coord, want: tuple[int, int], timeout: float = 20.0) -> tuple[int, int]:
    deadline = time.monotonic() + timeout
    got = _feeds(coord)
    while got != want and time.monotonic() < deadline:
        time.sleep(0.1)
        got = _feeds(coord)
    return got


def test_clients_that_went_away_leave_no_feed(demo_deployment):
    coord = replica(demo_deployment, "tp1").coordinator
    base = _settles_at(coord, _feeds(coord), 0)

    async def one_client(k: int) -> int:  # its own event loop, closed when it returns
        backend = RayBackend(coord, "colocated", 0)
        got = 0
        async for item in backend.generate(uid(f"feed-{k}"), prompt(8, k), {"max_tokens": 2, "ignore_eos": True}):
            got += len(item.get("token_ids") or ())
        return got

    assert [asyncio.run(one_client(k)) for k in range(5)] == [2] * 5
    assert _settles_at(coord, base) == base


def test_a_lapsed_gateways_feed_ends(demo_deployment):
    coord = replica(demo_deployment, "tp1").coordinator
    base = _feeds(coord)
    gateway = uid("gw-gone")
    ray.get(coord.renew_gateway.remote(gateway, 0.5))
    stream = coord.feed.remote(uid("feed-of-gone"), gateway=gateway)  # opened, then never read or closed
    assert _settles_at(coord, (base[0] + 1, base[1] + 1)) == (base[0] + 1, base[1] + 1)
    assert _settles_at(coord, base) == base  # the lease ran out: the feed went with it
    del stream
