"""FeedRegistry (hyrax/actors/engine/feed_registry.py): a feed's stream ends and its entry goes
when its consumer closes it or its gateway lapses; nothing of a closed feed is left."""
from __future__ import annotations

import asyncio

from hyrax.actors.engine.feed_registry import FeedRegistry
from hyrax.actors.engine.gateway_leases import GatewayLeases


def _registry() -> FeedRegistry:
    return FeedRegistry(lambda gateway: (lambda request_id: None))


async def _drain(reg: FeedRegistry, feed_id: str, gateway=None) -> list:
    return [b async for b in reg.stream(feed_id, gateway)]


def test_close_ends_the_stream_after_the_batches_before_it_and_drops_the_entry():
    async def main():
        reg = _registry()
        sink = reg.sink("f", None)
        task = asyncio.ensure_future(_drain(reg, "f"))
        await asyncio.sleep(0)
        sink.post([("r1", {"token_ids": [1]})])
        sink.post([("r1", {"token_ids": [2]})])
        await asyncio.sleep(0)
        assert reg.close("f") and len(reg) == 0
        got = await asyncio.wait_for(task, 5)
        assert [item["token_ids"] for batch in got for _, item in batch] == [[1], [2]]
        assert len(reg) == 0 and not reg.close("f")
    asyncio.run(main())


def test_a_stream_opened_after_its_close_ends_at_once():
    async def main():
        reg = _registry()
        reg.sink("f", None)
        reg.close("f")
        assert await asyncio.wait_for(_drain(reg, "f"), 5) == [] and len(reg) == 0
    asyncio.run(main())


def test_close_gateway_closes_only_that_gateways_feeds():
    async def main():
        reg = _registry()
        tasks = {fid: asyncio.ensure_future(_drain(reg, fid, gw)) for fid, gw in (("a", "g1"), ("b", "g1"), ("c", "g2"))}
        await asyncio.sleep(0)
        assert len(reg) == 3
        assert reg.close_gateway("g1") == 2
        await asyncio.wait_for(asyncio.gather(tasks["a"], tasks["b"]), 5)
        assert len(reg) == 1 and not tasks["c"].done()
        reg.close_gateway_soon("g2")  # as the lease thread calls it
        await asyncio.wait_for(tasks["c"], 5)
        assert len(reg) == 0
    asyncio.run(main())


def test_a_dropped_stream_drops_its_entry():
    async def main():
        reg = _registry()
        gen = reg.stream("f", None)
        task = asyncio.ensure_future(gen.__anext__())
        await asyncio.sleep(0)
        assert len(reg) == 1
        task.cancel()  # the generator is cancelled where it waits (a consumer that went away)
        await asyncio.gather(task, return_exceptions=True)
        await gen.aclose()
        assert len(reg) == 0
    asyncio.run(main())


def test_leases_report_each_lapsed_gateway_once():
    g = GatewayLeases()
    g.renew("gw1", 1.0, now=0.0)
    g.open("gw1", "r1", now=0.0)
    g.renew("gw2", 5.0, job="02000000", now=0.0)
    assert g.expired(now=2.0) == ["r1"]
    assert g.take_lapsed() == [("gw1", None)] and g.take_lapsed() == []
    assert g.expired(now=6.0) == [] and g.take_lapsed() == [("gw2", "02000000")]  # with its process's job
    assert not g.knows("gw2")


def test_a_submit_after_the_close_leaves_no_entry():
    async def main():
        reg = _registry()
        reg.sink("f", None)
        reg.close("f")
        sink = reg.sink("f", None)  # a request submitted on the closed feed: its batches go nowhere
        sink.post([("r1", {"token_ids": [1]})])
        await asyncio.sleep(0)
        assert len(reg) == 0
    asyncio.run(main())
