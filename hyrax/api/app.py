"""Gateway app factory: OpenAI routes, admin routes, ops routes. The engine client is
injected, so tests can pass an in-process engine."""
from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from fastapi import FastAPI, Request, Response
from prometheus_client import CONTENT_TYPE_LATEST

from hyrax import __version__
from hyrax.api import admin_routes, dashboard_routes, docs_routes, openai_routes, tokenize_routes
from hyrax.api.errors import error_response, install_handlers
from hyrax.api.health import NOT_CHECKED
from hyrax.api.metrics import GatewayMetrics
from hyrax.api.metrics import render as render_metrics
from hyrax.api.query_params import QueryCheck


@dataclass
class GatewaySettings:
    admin_token: str | None = None
    api_keys: tuple[str, ...] = ()
    max_body_bytes: int = 4 * 2**20
    health_interval_s: float = 2.0
    extra_version: dict = field(default_factory=dict)


class BodyLimit:
    """413 for request bodies over the limit, judged by Content-Length or, without one, by
    reading at most limit + 1 bytes (then handed to the route as they were received).

    A plain ASGI middleware: responses pass through it untouched. As a BaseHTTPMiddleware it
    relayed every chunk of a streamed response through a memory stream and a task of its own,
    the largest cost of a streamed token in the gateway."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        n = dict(scope["headers"]).get(b"content-length")
        if n is not None:
            if n.isdigit() and int(n) > self.limit:
                return await self._too_big(scope, receive, send)
            return await self.app(scope, receive, send)
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before its body ended
                return await self.app(scope, _replay([message], receive), send)
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.limit:
                return await self._too_big(scope, receive, send)
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)

    async def _too_big(self, scope, receive, send) -> None:
        await error_response(413, f"request body exceeds {self.limit} bytes", code="body_too_large")(
            scope, receive, send)


def _replay(messages: list[dict], receive):
    """An ASGI receive that returns `messages` first, then what `receive` returns."""
    pending = list(messages)

    async def replayed():
        return pending.pop(0) if pending else await receive()

    return replayed


def create_app(client, settings: GatewaySettings, deployment_events=None) -> FastAPI:
    """The gateway over `client`. `deployment_events`: an async callable answering the deployment
    controller's `EventPage` (hyrax/cluster/event_log.py) for `GET /admin/events`; None where no
    controller runs the replicas (an in-process engine)."""
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        async def watch():
            while True:
                h = await client.health()
                app.state.ready, app.state.health = h.ready, h
                await asyncio.sleep(settings.health_interval_s)

        task = asyncio.create_task(watch())
        try:
            yield
        finally:
            task.cancel()

    # redirect_slashes off: `/v1/completions/` is a path no route has (an OpenAI-shaped 404), not
    # a bare 307 to `/v1/completions` that a client posting JSON does not follow
    app = FastAPI(title="Hyrax", version=__version__, lifespan=lifespan, docs_url=None, redoc_url=None,
                  redirect_slashes=False)
    app.state.client = client
    app.state.deployment_events = deployment_events
    app.state.settings = settings
    app.state.ready = False
    app.state.health = NOT_CHECKED  # the last health round's report (hyrax/api/health.py)
    app.state.started = int(time.time())
    app.state.metrics = GatewayMetrics()
    app.add_middleware(BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(QueryCheck)
    install_handlers(app)
    app.include_router(openai_routes.router)
    app.include_router(admin_routes.router)
    app.include_router(tokenize_routes.router)
    app.include_router(dashboard_routes.router)
    docs_routes.install(app)

    @app.get("/health")
    async def health(request: Request):
        """Readiness and each replica's state, for probes and load balancers (no token): never a
        replica's own words, which hold exception text and addresses (GET /admin/health has them)."""
        h = await client.health()
        request.app.state.ready, request.app.state.health = h.ready, h
        if not h.ready:
            return error_response(503, f"not ready: {'; '.join(h.public_reasons)}", code="unavailable",
                                  headers={"Retry-After": "5"})
        return {"status": "ok", **h.public()}

    @app.get("/metrics")
    async def metrics():
        return Response(await render_metrics(client, app.state.metrics, app.state.deployment_events),
                        media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": __version__, "model": client.model.name, **settings.extra_version}

    return app
