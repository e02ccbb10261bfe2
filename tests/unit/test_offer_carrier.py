"""A gateway that lost its lease on a replica (its process killed, or frozen past the lease) also
carried the hand-offs that replica offered on its streams: nobody will bring those offers to an
importer now, so the replica frees them when it aborts that gateway's streams, not when each
offer's own lease ends (before, a prefill replica kept their pages and slots that long after
the gateway was gone). Offers carried by another gateway stay; an acknowledgement from an
importer that got the hand-off before, whether it arrives before or after, frees nothing twice.

The coordinator's own lease thread (`_expire_gateways`, the actor's class undecorated) runs on a
stand-in `self` with a real engine loop, its feeds and its gateway leases."""
from __future__ import annotations

import asyncio
import contextlib
import functools
import threading
from types import SimpleNamespace

from engine_helpers import HYBRID, assert_idle_clean, make_engine, tiny_model
from hyrax.actors.engine.feed_registry import FeedRegistry
from hyrax.actors.engine.gateway_leases import GatewayLeases
from hyrax.actors.engine.loop import EngineLoop
from test_coordinator_calls import Coordinator, _wait_for


def _owners(engine) -> set[str]:
    """The requests that own a unit of any device pool."""
    return {o for a in engine.alloc.values() for o in a.owners()}


@contextlib.contextmanager
def _replica(role: str, gateways: tuple[str, ...]):
    """A replica's engine loop, its feeds and gateway leases (each gateway renewed far beyond the
    test), and `submit(rid, gateway, prompt, max_tokens)`, as the coordinator's `submit`. The offer
    lease is far beyond the test too: only a gateway's lapse can free an offer here."""
    engine = make_engine(tiny_model(HYBRID), role=role, prefix_cache=False, offer_lease_s=600.0)
    loop = EngineLoop(engine, role)
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    leases = GatewayLeases()
    feeds = FeedRegistry(lambda gateway: functools.partial(leases.close, gateway))
    for gw in gateways:
        leases.renew(gw, 600.0)

    async def sink(gateway: str):  # made on the coordinator's event loop
        return feeds.sink(f"feed-{gateway}", gateway)

    def submit(rid: str, gateway: str, prompt: list[int], max_tokens: int) -> None:
        leases.open(gateway, rid)
        loop.submit(rid, prompt, {"max_tokens": max_tokens, "ignore_eos": True},
                    asyncio.run_coroutine_threadsafe(sink(gateway), aloop).result(10))
    try:
        yield engine, loop, SimpleNamespace(loop=loop, gateways=leases, feeds=feeds), submit
    finally:
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)


def _lapse(coord, gateway: str) -> threading.Thread:
    """The coordinator's lease thread, running; `gateway`'s renewals stopped: its lease ran out."""
    lapse = threading.Thread(target=Coordinator._expire_gateways, args=(coord,), daemon=True)
    lapse.start()
    coord.gateways.renew(gateway, 0.0)
    return lapse


def test_a_lapsed_gateways_offers_are_freed_with_its_streams_and_no_acknowledgement_frees_twice():
    carried = {"gone-acked": "gw-gone", "gone": "gw-gone", "alive": "gw-alive"}
    with _replica("prefill", ("gw-gone", "gw-alive")) as (engine, loop, coord, submit):
        for k, (rid, gw) in enumerate(carried.items()):
            submit(rid, gw, [3 + k, 4, 5, 6, 7], 30)
        # each stream ends with its hand-off after the first token: carried by its gateway now
        _wait_for(lambda: set(engine.handoffs) == set(carried) and not loop.streams, "the prompts were never offered")
        assert _owners(engine) == set(carried)
        # an importer of "gone-acked" acknowledged before its gateway's lease ran out
        assert loop.release("gone-acked") is True
        lapse = _lapse(coord, "gw-gone")
        _wait_for(lambda: "gone" not in engine.handoffs, "the lapsed gateway's offer was kept")
        with loop.lock:
            assert set(engine.handoffs) == {"alive"} and _owners(engine) == {"alive"}
            s = engine.stats
            assert (s.offers_reclaimed, s.transfers_out) == (1, 1)  # the acknowledged one not again
        # an importer that took "gone" before the gateway went acknowledges now: nothing to free
        assert loop.release("gone") is False
        assert loop.release("alive") is True  # the living gateway's offer reached its importer
        _wait_for(loop.is_idle_clean, "the pools never came back to their baseline")
        with loop.lock:
            assert (engine.stats.offers_reclaimed, engine.stats.transfers_out) == (1, 2)
            assert_idle_clean(engine)
        assert lapse.is_alive()


def test_a_migration_a_lapsed_gateway_carries_is_freed_with_its_streams():
    """A live migration's hand-off ends its stream too (the admin's migrate): the gateway that
    streams the request carries it to the target."""
    with _replica("colocated", ("gw-gone",)) as (engine, loop, coord, submit):
        submit("moving", "gw-gone", [5, 6, 7, 8], 400)
        _wait_for(lambda: len(getattr(engine.requests.get("moving"), "output_ids", ())) >= 3, "the request never ran")
        assert loop.migrate_out("moving") is True
        assert set(engine.handoffs) == {"moving"} and not loop.streams
        lapse = _lapse(coord, "gw-gone")
        _wait_for(loop.is_idle_clean, "the lapsed gateway's migration kept its state")
        with loop.lock:
            assert (engine.stats.offers_reclaimed, engine.stats.transfers_out) == (1, 0)
            assert_idle_clean(engine)
        assert lapse.is_alive()
