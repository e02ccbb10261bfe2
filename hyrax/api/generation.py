"""Runs the choices of one API call (prompts x n) through the engine client and merges
their streams. Closing the merged stream (client disconnect) cancels every choice, which
aborts its request on the replica and frees its memory on every rank."""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import AsyncIterator

from hyrax.api.text import TextStream


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
    logprobs: list[dict] = field(default_factory=list)  # one per token, when asked for


async def run_choices(client, choices: list[Choice], metrics=None) -> AsyncIterator[tuple[Choice, str, bool]]:
    """Yields (choice, text delta, finished) as tokens arrive, from all choices interleaved."""
    q: asyncio.Queue = asyncio.Queue()
    timers = {c.index: metrics.timer() for c in choices} if metrics is not None else {}

    async def pump(c: Choice):
        try:
            async for item in client.generate(c.request_id, c.prompt_ids, c.params):
                await q.put((c, item))
        except Exception as e:  # noqa: BLE001 - a replica failure ends this choice with an error
            await q.put((c, {"error": f"replica failed: {type(e).__name__}", "finished": True,
                             "finish_reason": "error", "token_ids": []}))

    tasks = [asyncio.create_task(pump(c)) for c in choices]
    open_ = len(choices)
    try:
        while open_:
            c, item = await q.get()
            if item.get("error"):
                c.error = item["error"]
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
            yield c, delta, bool(item.get("finished"))
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
