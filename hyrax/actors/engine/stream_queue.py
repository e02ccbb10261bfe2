"""One request's items on its consumer's side (a `step_feed.Fanout` queue), bounded without
losing, reordering or mixing a token.

The consumer's event loop hands each item of a step batch to its request's queue; the request's
stream (an HTTP response) takes them as fast as its client reads. A slow client left one item a
step in an unbounded queue for as long as it lagged. Past `limit` items, an item that carries only
tokens is joined onto the one before it (item_join.py's rules, shared with the replica's feed
queue): the queue then holds about `limit` items, the last of them growing, and the stream reads
every token, with its logprobs, in order, in fewer items. An import's first item, a hand-off, an
error, a refusal, the stream's last item, anything other than a dict, and any item with a key the
join does not know are queued as they are. Memory still grows with the tokens themselves (bounded
by the request's `max_tokens`), no longer with the steps. Used on one event loop.
"""
from __future__ import annotations

import asyncio
from collections import deque

from hyrax.actors.engine.item_join import join, join_onto, joinable, plain

JOIN_AFTER = 8  # items a request's queue holds before it joins the next onto the last (a few steps)


class StreamQueue:
    """The items of one request's stream not taken yet: `put_nowait` and `get`, as an asyncio.Queue's."""

    def __init__(self, limit: int | None = None):
        self.limit = JOIN_AFTER if limit is None else limit
        self.joins = 0  # items joined onto the one before them (steps its reader lagged past `limit`)
        self.most = 0  # the most items it held at once
        self._items: deque = deque()
        self._made: object = None  # the last item when this queue made it by a join (joined onto in place)
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._items)

    def qsize(self) -> int:
        return len(self._items)

    def empty(self) -> bool:
        return not self._items

    def put_nowait(self, item: object) -> bool:
        """True when `item` was queued as a new item, False when it was joined onto the last."""
        if len(self._items) >= self.limit and plain(item) and joinable(self._items[-1], item):
            last = self._items[-1]
            self._items[-1] = self._made = join_onto(last, item) if last is self._made else join(last, item)
            self.joins += 1
            return False
        self._items.append(item)
        self.most = max(self.most, len(self._items))
        self._ready.set()
        return True

    async def get(self) -> object:
        while not self._items:
            self._ready.clear()
            await self._ready.wait()
        item = self._items.popleft()
        if item is self._made:  # the stream has it now: never joined onto again
            self._made = None
        return item
