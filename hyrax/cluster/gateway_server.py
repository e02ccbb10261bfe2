"""The gateway's HTTP server: uvicorn's, with a shutdown that ends open streams cleanly.

On SIGTERM or Ctrl-C uvicorn stops accepting connections, waits up to its graceful-shutdown
timeout for the open ones to finish, then cancels what still runs: a stream cancelled there
reaches its client cut off (no last chunk, no `data: [DONE]`) and logs a traceback of the
cancellation. Here open streams get `grace_s` seconds to finish on their own; then every
request still open is aborted, so each stream ends the ordinary way — a last chunk with
finish_reason "abort", usage if asked for, `data: [DONE]` — and its request is freed on the
replicas. uvicorn's own timeout is set `END_WAIT_S` later and only matters when a replica does
not answer the abort.
"""
from __future__ import annotations

import asyncio

import uvicorn

END_WAIT_S = 3.0  # after the grace period: time for the aborts to be answered and the last chunks sent


class GatewayServer(uvicorn.Server):
    def __init__(self, app, client, grace_s: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=int(grace_s + END_WAIT_S) + 1, **config))
        self.client, self.grace_s = client, grace_s
        self.streams_ended = 0  # requests still open when the grace period ran out

    async def shutdown(self, *args, **kwargs) -> None:
        ender = asyncio.ensure_future(self._end_streams())
        try:
            await super().shutdown(*args, **kwargs)
        finally:
            ender.cancel()

    async def _end_streams(self) -> None:
        await asyncio.sleep(self.grace_s)
        self.streams_ended = await self.client.end_streams(END_WAIT_S)
