"""A replica's open feeds: one per engine client's event loop (a gateway's), each a queue of step
batches that the coordinator's `feed` streaming generator drains (coordinator.py).

A feed ends, and its entry and generator with it, when its consumer says it is done (`close`:
the client's feed task ended, e.g. its event loop closed) or when the gateway it belongs to lost
its lease (`close_gateway`: the gateway's process is gone). Before, an entry and a generator
waiting on its queue stayed for every consumer that ever opened a feed (measured: 20 short-lived
clients left 20 of each), against "a client that disappears leaves nothing allocated".
Used on the coordinator's event loop only; `close_gateway_soon` is the one call from other
threads. Ray-free.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import AsyncIterator, Callable

from hyrax.actors.engine.feed_queue import FeedQueue
from hyrax.actors.engine.step_feed import Batch, Sink

REMEMBER_CLOSED = 4096  # closed feed ids kept, so that a stream opened after its close ends at once


def _drop(batch: Batch) -> None:
    return None


class FeedRegistry:
    def __init__(self, on_end: Callable[[str | None], Callable[[str], None]]):
        """on_end(gateway): what a feed's sink runs when one of its streams ended (the lease's close)."""
        self._on_end = on_end
        self._feeds: dict[str, tuple[Sink, FeedQueue, str | None]] = {}
        self._closed: OrderedDict[str, None] = OrderedDict()
        self.aloop: asyncio.AbstractEventLoop | None = None

    def __len__(self) -> int:
        return len(self._feeds)

    def _entry(self, feed_id: str, gateway: str | None) -> tuple[Sink, FeedQueue, str | None]:
        if feed_id not in self._feeds:  # made by whichever of `stream`/`sink` comes first
            self.aloop = asyncio.get_running_loop()
            q = FeedQueue()
            self._feeds[feed_id] = (Sink(q.put, self.aloop, self._on_end(gateway), gateway), q, gateway)
        return self._feeds[feed_id]

    def summary(self) -> dict:
        """Open feeds, the batches they hold that their gateways have not taken, and how many
        times a feed folded what it held (its gateway lagged FOLD_AFTER steps)."""
        queues = [q for _, q, _ in self._feeds.values()]
        return {"open": len(queues), "batches_held": sum(map(len, queues)), "folds": sum(q.folds for q in queues)}

    def pending(self, feed_id: str) -> int:
        """How many batches `feed_id` holds that its gateway has not taken (bounded: feed_queue.py)."""
        entry = self._feeds.get(feed_id)
        return 0 if entry is None else len(entry[1])

    def sink(self, feed_id: str, gateway: str | None) -> Sink:
        """Where the streams submitted on `feed_id` post their batches. A submit that arrives
        after its feed was closed gets a sink that drops them (nobody reads that feed any more)
        rather than a new entry that nothing would ever remove."""
        if feed_id in self._closed and feed_id not in self._feeds:
            return Sink(_drop, asyncio.get_running_loop(), self._on_end(gateway), gateway)
        return self._entry(feed_id, gateway)[0]

    async def stream(self, feed_id: str, gateway: str | None) -> AsyncIterator[Batch]:
        """The feed's batches, one per engine step (batches not taken yet go out joined, folded
        per request once there were many: feed_queue.py), until the feed is closed; then its
        entry is gone."""
        if feed_id in self._closed:
            return
        _, q, _ = self._entry(feed_id, gateway)
        try:
            while (batch := await q.take()) is not None:
                yield batch
        finally:  # closed, or the generator was cancelled or dropped
            if self._feeds.get(feed_id, (None, None))[1] is q:
                del self._feeds[feed_id]

    def close(self, feed_id: str) -> bool:
        """The consumer of `feed_id` is done: its stream ends and its entry goes. False if there
        was none. What a stream still submitted on it posts later is not kept: nobody reads it
        (its client aborts what it was reading)."""
        self._closed[feed_id] = None
        while len(self._closed) > REMEMBER_CLOSED:
            self._closed.popitem(last=False)
        entry = self._feeds.pop(feed_id, None)
        if entry is None:
            return False
        entry[1].end()
        return True

    def close_gateway(self, gateway: str) -> int:
        """Close every feed of `gateway`; how many."""
        ids = [fid for fid, (_, _, gw) in self._feeds.items() if gw == gateway]
        for fid in ids:
            self.close(fid)
        return len(ids)

    def close_gateway_soon(self, gateway: str) -> None:
        """`close_gateway` from any thread (on the event loop the feeds live on)."""
        if self.aloop is not None and not self.aloop.is_closed():
            self.aloop.call_soon_threadsafe(self.close_gateway, gateway)
