"""A replica stream that ends before its request finished (a transport cut, a replica lost
between items) reaches the client as an error item, never as a silently truncated answer, and
the request is aborted on the replica."""
from __future__ import annotations

import asyncio

from engine_helpers import HYBRID, make_engine, tiny_model
from hyrax.actors.engine.loop import EngineLoop
from hyrax.api.client import EngineClient, LocalBackend, ModelInfo


class CutTransport(LocalBackend):
    """The real in-process replica; its stream to the gateway is cut after `keep` items."""

    def __init__(self, loop, keep: int):
        super().__init__(loop)
        self.keep = keep

    async def _cut(self, stream):
        n = 0
        async for item in stream:
            yield item
            n += 1
            if n >= self.keep:
                return

    def generate(self, request_id, prompt_ids, params):
        return self._cut(super().generate(request_id, prompt_ids, params))


def test_a_stream_cut_short_ends_with_an_error_and_the_request_is_aborted():
    loop = EngineLoop(make_engine(tiny_model(HYBRID), prefix_cache=False), "cut")
    try:
        client = EngineClient(ModelInfo("cut", 4096, None, None, 96), [CutTransport(loop, keep=2)])

        async def consume():
            return [item async for item in client.generate("r1", [5, 6, 7], {"max_tokens": 50, "ignore_eos": True})]

        items = asyncio.run(consume())
        assert items[-1].get("finish_reason") == "error" and items[-1].get("finished"), items[-1]
        assert "stopped before" in items[-1]["error"]
        for _ in range(200):
            if loop.is_idle_clean():
                break
            asyncio.run(asyncio.sleep(0.02))
        assert loop.is_idle_clean()
    finally:
        loop.shutdown()
