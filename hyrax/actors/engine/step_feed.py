"""Step batches: what one engine step produced for one consumer's streams, sent as one message.

After each step the engine loop's thread posts one batch per consumer, `[(request id, item), ...]`
in the order the engine produced the items, instead of one message per token per request. A
consumer is an asyncio event loop: the in-process client's, or the coordinator's feed to one
gateway (one Ray streaming generator per gateway and replica, which the gateway fans out to its
HTTP streams: hyrax/cluster/ray_client.py). A `Fanout` on the consumer's side hands each item
to its request's queue (bounded for a stream that reads slowly: stream_queue.py); `follow` reads
one request's queue to its last item.

An item is the last of its stream when it finishes the request or hands it off (`is_last`).
Ray-free.
"""
from __future__ import annotations

import asyncio
from typing import AsyncIterator, Callable

from hyrax.actors.engine.stream_queue import StreamQueue

Batch = list[tuple[str, dict]]


def is_last(item: dict) -> bool:
    return bool(item.get("finished")) or "handoff" in item


def error_item(message: str, status: int = 400) -> dict:
    """A stream's last item when it ends in an error; `status`: the HTTP status the gateway
    answers with when the stream had no tokens (400: the input; 503: retry elsewhere)."""
    return {"error": message, "status": status, "finished": True, "finish_reason": "error", "token_ids": []}


def refusal_item(message: str) -> dict:
    """A stream's one item when its replica turned the request away before admitting it (a
    closed loop, a loop shutting down, a replica whose actor is gone): nothing of it ran there,
    so the gateway may send it to another replica (`is_refusal`). 503 where none is left."""
    return dict(error_item(message, 503), refused=True)


def is_refusal(item: dict) -> bool:
    """Whether `item` is a refusal at admission (`refusal_item`), which only a stream's first item can be."""
    return item.get("refused") is True


class Sink:
    """One consumer's entry, safe to call from any thread: `post(batch)` runs `deliver(batch)`
    on the consumer's event loop, batches in the order they were posted. `on_end(request_id)`
    runs (on the posting thread) when a stream of this consumer ended: last item posted.
    `gateway`: the gateway whose lease holds this consumer's streams (None: none, an in-process
    caller); a stream that ends with a hand-off leaves that gateway carrying the offer."""

    def __init__(self, deliver: Callable[[Batch], None], aloop: asyncio.AbstractEventLoop | None = None,
                 on_end: Callable[[str], None] | None = None, gateway: str | None = None):
        self.aloop = aloop or asyncio.get_running_loop()
        self.deliver, self.on_end, self.gateway = deliver, on_end, gateway
        self.posted = 0  # batches posted: the messages this consumer was sent

    def post(self, batch: Batch) -> bool:
        """False when the consumer's event loop is closed: nobody reads its streams any more."""
        try:
            self.aloop.call_soon_threadsafe(self.deliver, batch)
        except RuntimeError:
            if not self.aloop.is_closed():
                raise
            return False
        self.posted += 1
        return True


class Fanout:
    """Per-request queues behind one consumer; used on its event loop only."""

    def __init__(self):
        self.queues: dict[str, StreamQueue] = {}

    def open(self, request_id: str) -> StreamQueue:
        q = self.queues[request_id] = StreamQueue()
        return q

    def close(self, request_id: str, q: StreamQueue) -> None:
        """The stream that opened `q` is done: its queue goes, unless a later stream of the same
        request (an offer taken back by its source, on the same consumer) opened its own since."""
        if self.queues.get(request_id) is q:
            del self.queues[request_id]

    def dispatch(self, batch: Batch) -> None:
        for rid, item in batch:
            q = self.queues.get(rid)
            if q is not None:
                q.put_nowait(item)

    def broadcast(self, item: object) -> None:
        """The same item (a copy each, if a dict) to every open stream: the feed itself ended."""
        for q in self.queues.values():
            q.put_nowait(dict(item) if isinstance(item, dict) else item)

    def __len__(self) -> int:
        return len(self.queues)


async def follow(q: StreamQueue) -> AsyncIterator[dict]:
    """One request's items, up to and including its last."""
    while True:
        item = await q.get()
        yield item
        if is_last(item):
            return
