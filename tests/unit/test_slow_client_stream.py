"""A client that reads its streamed answer slowly gets the same answer as one that reads it at
once: the same text, byte for byte, the same logprobs (and completions' text offsets), the same
usage, for each of n choices. Meanwhile the gateway holds a few items per choice for it, each
token item it could not send yet joined onto the one before (stream_queue.py), not one item per
engine step: after its stall it is sent a few events, not one per token.

The gateway is the real app over a real in-process engine loop (a tiny model, greedy), driven
through ASGI: the slow client's `send` of the first event returns only once the engine has
produced every token, as a server's send waits while its client does not read."""
from __future__ import annotations

import asyncio
import json

import pytest

from engine_helpers import HYBRID, make_engine, tiny_model
from gateway_fakes import gateway
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine import stream_queue
from hyrax.actors.engine.stream_queue import JOIN_AFTER
from hyrax.api.client import LocalBackend

TOKENS = 300
N = 2
BODIES = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "!#%"}], "logprobs": True, "top_logprobs": 2},
    "/v1/completions": {"prompt": [5, 6, 7], "logprobs": 2},
}
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the tiny model's ids are under 96: no letters


@pytest.fixture(scope="module")
def served():
    loop = EngineLoop(make_engine(tiny_model(HYBRID), prefix_cache=False), "slow-client")
    try:
        yield loop, gateway(LocalBackend(loop), chat_template=TEMPLATE).app
    finally:
        loop.shutdown()


async def _call(app, path: str, body: dict, until=None) -> list[bytes]:
    """The body chunks of a POST to `app`; with `until`, the first one's send waits for it."""
    raw = json.dumps(body).encode()
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())],
             "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8000)}
    gone, first, status = asyncio.Event(), [True], []
    chunks: list[bytes] = []

    async def receive():
        if first[0]:
            first[0] = False
            return {"type": "http.request", "body": raw, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        if message["type"] == "http.response.start":
            status.append(message["status"])
        elif message["type"] == "http.response.body" and message.get("body"):
            chunks.append(message["body"])
            if until is not None and len(chunks) == 1:
                await until()

    await app(scope, receive, send)
    gone.set()
    assert status == [200], (status, chunks)
    return chunks


def _answer(path: str, chunks: list[bytes]) -> tuple[dict, list[dict]]:
    """Per choice: its text, its logprobs, its finish reason; the usage. And the events themselves."""
    events = [json.loads(line[6:]) for line in b"".join(chunks).decode().splitlines()
              if line.startswith("data: {")]
    text: dict[int, str] = {}
    lps: dict[int, list] = {}
    finish: dict[int, str] = {}
    usage = None
    for ev in events:
        usage = ev.get("usage") or usage
        for c in ev["choices"]:
            i = c["index"]
            text[i] = text.get(i, "") + ((c.get("delta") or {}).get("content") or "" if "delta" in c else c["text"])
            lp = c.get("logprobs")
            if lp and "content" in lp:
                lps.setdefault(i, []).extend(lp["content"])
            elif lp:
                for k, v in lp.items():
                    lps.setdefault(i, {}).setdefault(k, []).extend(v)
            if c.get("finish_reason"):
                finish[i] = c["finish_reason"]
    return {"text": text, "logprobs": lps, "finish": finish, "usage": usage}, events


@pytest.mark.parametrize("path", list(BODIES))
def test_a_slow_client_gets_the_answer_a_fast_one_does_from_a_few_items_held(served, path):
    """The fast client's answer is the reference, with nothing joined (a gateway whose event loop
    lagged the engine for a moment joins items for a fast client too)."""
    loop, app = served
    body = {"model": "m", "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0, "n": N, "stream": True,
            "stream_options": {"include_usage": True}, **BODIES[path]}

    async def everything_generated():
        for _ in range(3000):
            await asyncio.sleep(0.01)
            if loop.is_idle_clean():
                break
        await asyncio.sleep(0.3)  # the last steps' items reach the gateway's queues

    with pytest.MonkeyPatch.context() as mp:  # the reference: every item as the engine sent it, none joined
        mp.setattr(stream_queue, "JOIN_AFTER", 10**9)
        fast, fast_events = _answer(path, asyncio.run(_call(app, path, body)))
    slow, slow_events = _answer(path, asyncio.run(_call(app, path, body, until=everything_generated)))
    assert fast["finish"] == {i: "length" for i in range(N)}, fast["finish"]
    assert fast["usage"]["completion_tokens"] == N * TOKENS
    assert all(len(t) == TOKENS for t in fast["text"].values())  # a byte a token (the gateway's byte tokenizer)
    assert slow == fast
    # the reference was sent an event a token; the slow client, after its stall, a few per choice
    assert len(fast_events) > N * TOKENS
    assert len(slow_events) <= N * (JOIN_AFTER + 3) + 2, len(slow_events)
