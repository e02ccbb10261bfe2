"""Runs the choices of one API call (prompts x n) through the engine client and merges
their streams. Closing the merged stream (client disconnect) cancels every choice, which
aborts its request on the replica and frees its memory on every rank.

The routes never rely on garbage collection to notice a client that left: a streaming
response closes its event generator explicitly when the connection ends
(`ClosingStreamingResponse`), and a non-streaming call races the engine against the
connection (`until_disconnected`)."""
from __future__ import annotations

import asyncio
import logging
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from starlette.responses import StreamingResponse

from hyrax.actors.engine.step_feed import error_item
from hyrax.actors.engine.stream_queue import StreamQueue
from hyrax.api.text import TextStream

log = logging.getLogger("hyrax.api")


@dataclass
class Choice:
    index: int
    prompt_ids: list[int]
    params: dict
    text: TextStream
    request_id: str = field(default_factory=lambda: f"req-{uuid.uuid4().hex[:16]}")
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 400  # the HTTP status an error that produced no tokens maps to
    logprobs: list[dict] = field(default_factory=list)  # one per token, when asked for


async def run_choices(client, choices: list[Choice], metrics=None,
                      reservation=None) -> AsyncIterator[tuple[Choice, str, bool]]:
    """Yields (choice, text delta, finished) as tokens arrive, from all choices interleaved.
    `reservation`: the admission of these choices, released as each one ends.

    Each choice's stream is read as its items come (a hand-off is passed on at once, whatever
    the client does); what the caller has not taken yet (a client reading its answer slowly)
    waits in the choice's queue, which joins its token items once they pile up (stream_queue.py)."""
    held = {c.index: StreamQueue() for c in choices}  # each choice's items not taken yet
    turns: asyncio.Queue = asyncio.Queue()  # whose item comes next: one per item held, in the order they came
    timers = {c.index: metrics.timer() for c in choices} if metrics is not None else {}

    def hold(c: Choice, item: dict) -> None:
        if held[c.index].put_nowait(item):  # a new item, not tokens joined onto the last one held
            turns.put_nowait(c)

    async def pump(c: Choice):
        try:
            async for item in client.generate(c.request_id, c.prompt_ids, c.params):
                hold(c, item)
        except Exception:  # noqa: BLE001 - a replica failure ends this choice with an error (503: retry)
            log.exception("request %s: its replica's stream failed", c.request_id)  # the client is told no more
            hold(c, error_item("the replica serving this request failed", 503))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    open_ = len(choices)
    try:
        while open_:
            c = await turns.get()
            item = await held[c.index].get()  # there since its turn was queued
            if item.get("error"):
                c.error = item["error"]
                c.error_status = item.get("status", 400)
            if timers:
                timers[c.index].tokens(len(item.get("token_ids", [])))
                if item.get("finished"):
                    timers[c.index].done()
            delta = c.text.feed(item.get("token_ids", []))
            c.token_ids.extend(item.get("token_ids", []))
            c.logprobs.extend(item.get("logprobs", []))
            if item.get("finished"):
                delta += c.text.finish()
                c.finish_reason = "stop" if c.text.stopped else item.get("finish_reason")
                open_ -= 1
                if reservation is not None:
                    reservation.release()
            yield c, delta, bool(item.get("finished"))
    finally:
        for t in tasks:
            t.cancel()
        if reservation is not None:
            reservation.release_all()
        await asyncio.gather(*tasks, return_exceptions=True)


class ClosingStreamingResponse(StreamingResponse):
    """A streaming response that closes its body generator however the response ends (the
    client disconnected, the server is shutting down), so the choices behind it are aborted
    now — not whenever the suspended generator happens to be garbage-collected."""

    def __init__(self, content, on_close=None, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            try:
                await asyncio.shield(self.body_iterator.aclose())
            finally:
                if self.on_close is not None:
                    self.on_close()


async def until_disconnected(request, coro):
    """Await `coro` unless the client disconnects first; then cancel it (aborting what it
    runs) and raise ClientGone."""
    work = asyncio.ensure_future(coro)

    async def gone():
        while (await request.receive())["type"] != "http.disconnect":
            pass

    watch = asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (work, watch):
            if not t.done():
                t.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    if work.cancelled() or not work.done():
        await asyncio.gather(work, return_exceptions=True)
        raise ClientGone()
    return work.result()


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""
