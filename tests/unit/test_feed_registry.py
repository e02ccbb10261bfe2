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


def test_a_feed_whose_reader_stalls_stays_bounded_and_then_gets_every_token_in_order():
    """A gateway that reads its feed slowly left the replica one batch a step in an unbounded
    queue. Its reader stalls here for 3,000 steps of 6 requests (one finishes, one is handed off
    and comes back by import, one ends in an error, some with logprobs): the queue holds at most
    FOLD_AFTER batches throughout, and afterwards the reader gets every token of every request,
    in order, each stream's special items (imported, error, hand-off, end) as they were."""
    from hyrax.actors.engine.feed_queue import FOLD_AFTER

    def item(step, rid, **more):
        out = {"token_ids": [step], "finished": False, "finish_reason": None, **more}
        if rid in ("a", "c"):
            out["logprobs"] = [{"token": step, "logprob": -step / 1000}]
        return out

    async def main():
        reg = _registry()
        sink = reg.sink("f", None)
        want: dict[str, list] = {rid: [] for rid in "abcdef"}
        peak = 0
        for step in range(3000):
            batch = []
            for rid in "abcdef":
                if rid == "b" and step == 500:
                    it = {"token_ids": [step], "finished": True, "finish_reason": "length", "text": "x"}
                elif rid == "b" and step > 500:
                    continue
                elif rid == "d" and step == 700:  # handed off here, back by import at 900
                    it = {"token_ids": [step], "finished": False, "finish_reason": None, "handoff": {"h": 1}}
                elif rid == "d" and 700 < step < 900:
                    continue
                elif rid == "d" and step == 900:
                    it = {"token_ids": [], "finished": False, "finish_reason": None, "imported": "verified"}
                elif rid == "e" and step == 1200:
                    it = {"token_ids": [], "finished": True, "finish_reason": "error", "error": "e", "status": 503}
                elif rid == "e" and step > 1200:
                    continue
                elif rid == "f" and step == 2999:
                    it = {"token_ids": [step], "finished": True, "finish_reason": "length"}
                else:
                    it = item(step, rid)
                batch.append((rid, it))
                want[rid].append(it)
            sink.post(batch)
            await asyncio.sleep(0)  # the post runs on this loop: nobody takes it
            peak = max(peak, reg.pending("f"))
        assert peak <= FOLD_AFTER, f"{peak} batches held for a reader that stalled"
        got: dict[str, list] = {rid: [] for rid in "abcdef"}
        stream = reg.stream("f", None)  # the reader goes on: what was held, then the close
        batches = [await stream.__anext__()]
        reg.close("f")
        batches += [b async for b in stream]
        for rid, it in (entry for batch in batches for entry in batch):
            got[rid].append(it)
        assert sum(map(len, got.values())) < sum(map(len, want.values())) / 10  # folded, not one a step
        for rid in "abcdef":
            tokens = [t for it in got[rid] for t in it["token_ids"]]
            assert tokens == [t for it in want[rid] for t in it["token_ids"]], rid
            lps = [lp for it in got[rid] for lp in it.get("logprobs", [])]
            assert lps == [lp for it in want[rid] for lp in it.get("logprobs", [])], rid
            specials = [{k: v for k, v in it.items() if k not in ("token_ids", "logprobs")}
                        for it in got[rid] if set(it) - {"token_ids", "logprobs", "finished", "finish_reason"}
                        or it["finished"]]
            assert specials == [{k: v for k, v in it.items() if k not in ("token_ids", "logprobs")}
                                for it in want[rid] if set(it) - {"token_ids", "logprobs", "finished",
                                                                  "finish_reason"} or it["finished"]], rid
        assert got["d"][[i for i, it in enumerate(got["d"]) if "imported" in it][0] - 1].get("handoff")
    asyncio.run(main())
