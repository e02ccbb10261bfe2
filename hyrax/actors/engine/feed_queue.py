"""The step batches a replica holds for one feed until its gateway takes them (feed_registry.py),
bounded without losing or reordering a token.

A feed carries one batch per engine step, each item one request's tokens of that step. A gateway
that reads slowly (a busy event loop, a stalled node) left them in an unbounded queue, one batch
a step for as long as it lagged. Past `limit` batches the queue folds what it holds into one
batch: the consecutive items of each request become one item, its tokens (and logprobs) joined in
order. Then the queue holds at most `limit` batches, the folded one holding about one item per
request, and the reader gets every token, in order, in fewer items. Nothing is dropped: memory
still grows with the tokens themselves (each request's are bounded by its `max_tokens`), no
longer with the steps.

An item that carries more than tokens is never folded into: a request's first item after an
import (`imported`: the gateway skips its tokens), one with an `error`; nor is anything folded
into an item that ends its stream. The join and its rules are item_join.py's, which a request's
queue on the gateway shares (stream_queue.py). Ray-free; used on one event loop.
"""
from __future__ import annotations

import asyncio
from collections import deque

from hyrax.actors.engine.item_join import join, join_onto, joinable
from hyrax.actors.engine.step_feed import Batch

FOLD_AFTER = 64  # batches held for a feed before they are folded (~ a second of decode steps)
# batches Ray may have sent a feed's gateway that it has not taken yet: past that the replica's
# `feed` generator waits (Ray's generator backpressure) and its batches wait here, folded. Without
# it Ray sent one message a step to a gateway that did not read them, frozen or dead too.
IN_FLIGHT = 16


def fold(batch: Batch) -> Batch:
    """`batch` with each request's consecutive foldable items joined, each request's items in
    their order (requests in the order of their first item)."""
    out: Batch = []
    last: dict[str, int] = {}  # request id -> where its newest item is in `out`
    made: set[int] = set()  # where `out` holds an item this fold made (joined onto in place)
    for rid, item in batch:
        k = last.get(rid)
        if k is not None and joinable(out[k][1], item):
            out[k] = (rid, join_onto(out[k][1], item) if k in made else join(out[k][1], item))
            made.add(k)
        else:
            last[rid] = len(out)
            out.append((rid, item))
    return out


class FeedQueue:
    """A feed's batches not taken yet: `put` (from the replica's loop thread, through its Sink)
    and `take` (the feed's stream), ended by `end`."""

    def __init__(self, limit: int = FOLD_AFTER):
        self.limit = limit
        self.folds = 0  # how many times it folded (a reader that lagged `limit` steps)
        self.unread = 0  # batches put after the end, which no stream takes any more
        self._batches: deque[Batch] = deque()
        self._ended = False
        self._ready = asyncio.Event()

    def __len__(self) -> int:
        return len(self._batches)

    def put(self, batch: Batch) -> None:
        if self._ended:  # its stream returned: nobody reads this feed (its gateway aborts what it read)
            self.unread += 1
            return
        self._batches.append(batch)
        if len(self._batches) > self.limit:
            self._batches = deque([fold(self._joined())])
            self.folds += 1
        self._ready.set()

    def end(self) -> None:
        """The stream returns once it took what was put before; what is put later is not kept."""
        self._ended = True
        self._ready.set()

    async def take(self) -> Batch | None:
        """Every batch held, as one (folded when it was long); None once ended and empty."""
        while not self._batches and not self._ended:
            self._ready.clear()
            await self._ready.wait()
        if not self._batches:
            return None
        out = self._joined()
        self._batches.clear()
        return out

    def _joined(self) -> Batch:
        return [entry for batch in self._batches for entry in batch]
