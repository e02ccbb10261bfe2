"""Test support shared by tests/e2e and tests/observability: a free loopback port, polling
with a deadline, an ASGI app served by uvicorn on 127.0.0.1 in a daemon thread, and the one
HTTP client for the tests' single calls.

Importable from any test folder: tests/conftest.py puts this folder on sys.path.
"""
from __future__ import annotations

import threading

import httpx

from hyrax.testing.multinode import free_port, wait_until  # noqa: F401 - one copy, shared with hyrax bench

# The tests' single HTTP calls go through this client: `httpx.get(...)` and its siblings build a
# client per call, and with it an SSL context (the CA bundle parsed again): 75 ms a call on the
# loaded 2-core machine, 2 ms through a shared client. No keep-alive: as with httpx.get, every
# call has a connection of its own, which the client closes after the response.
HTTP = httpx.Client(limits=httpx.Limits(max_keepalive_connections=0))


class Gateway:
    """An ASGI app served by uvicorn on 127.0.0.1:<free port> in a daemon thread; waits for
    /health to answer 200."""

    def __init__(self, app, name: str = "gateway", make_server=None):
        """`make_server(app, host=, port=, log_level=)`: the uvicorn.Server to run (default:
        uvicorn's own, with a 2 s graceful shutdown)."""
        import uvicorn

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        opts = dict(host="127.0.0.1", port=self.port, log_level="warning")
        self.server = (make_server(app, **opts) if make_server is not None
                       else uvicorn.Server(uvicorn.Config(app, timeout_graceful_shutdown=2, **opts)))
        self.thread = threading.Thread(target=self.server.run, name=f"{name}-{self.port}", daemon=True)
        self.thread.start()

        def healthy():
            if not self.thread.is_alive():
                raise AssertionError("the gateway thread died while starting")
            try:
                return HTTP.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, 60, what=f"{self.url}/health")

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
