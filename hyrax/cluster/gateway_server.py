"""The gateway's HTTP server: uvicorn's, with a shutdown that ends open streams cleanly.

On SIGTERM or Ctrl-C uvicorn stops accepting connections, waits up to its graceful-shutdown
timeout for the open ones to finish, then cancels what still runs: a stream cancelled there
reaches its client cut off (no last chunk, no `data: [DONE]`) and logs a traceback of the
cancellation. Here open streams get `grace_s` seconds to finish on their own; then every
request still open is aborted, so each stream ends the ordinary way — a last chunk with
finish_reason "abort", usage if asked for, `data: [DONE]` — and its request is freed on the
replicas. uvicorn's own timeout is set `END_WAIT_S` later and only matters when a replica does
not answer the abort.

A second Ctrl-C (uvicorn's "force quit", which stops waiting and cuts every open stream off)
ends the grace period at once instead: the open streams are aborted now and end the same
ordinary way, within `END_WAIT_S`. A third one forces the exit as uvicorn does.
"""
from __future__ import annotations

import asyncio
import signal

import uvicorn

END_WAIT_S = 3.0  # after the grace period: time for the aborts to be answered and the last chunks sent
POLL_S = 0.05  # how often the grace period looks for a second Ctrl-C


class GatewayServer(uvicorn.Server):
    def __init__(self, app, client, grace_s: float, **config):
        super().__init__(uvicorn.Config(app, timeout_graceful_shutdown=int(grace_s + END_WAIT_S) + 1, **config))
        self.client, self.grace_s = client, grace_s
        self.streams_ended = 0  # requests still open when the grace period ran out
        self.hurry = False  # a second Ctrl-C came: the grace period is over

    def handle_exit(self, sig: int, frame) -> None:
        if self.should_exit and sig == signal.SIGINT and not self.hurry:
            self._captured_signals.append(sig)  # re-raised after the run, as uvicorn does with each
            self.hurry = True
            return
        super().handle_exit(sig, frame)

    async def shutdown(self, *args, **kwargs) -> None:
        ender = asyncio.ensure_future(self._end_streams())
        try:
            await super().shutdown(*args, **kwargs)
        finally:
            ender.cancel()

    async def _end_streams(self) -> None:
        loop = asyncio.get_running_loop()
        until = loop.time() + self.grace_s
        while not self.hurry and loop.time() < until:
            await asyncio.sleep(min(POLL_S, max(0.0, until - loop.time())))
        self.streams_ended = await self.client.end_streams(END_WAIT_S)
