"""Query strings: a query parameter the route does not declare is a 400 naming it
(`unknown_parameter`), never ignored. Request fields go in the JSON body: `POST
/v1/completions?stream=true` streamed nothing and said nothing. No route of the gateway declares
one today; a route that does (FastAPI's `Query`) takes its parameters, and a bad value is the
usual 400 naming it (errors.validation_error).

A plain ASGI middleware, so that it covers every route (the OpenAI and admin routes, /health,
/metrics, the dashboard, /openapi.json, the docs' assets). A path no route has, or a method the
path does not take, passes through to the 404 or 405."""
from __future__ import annotations

from urllib.parse import parse_qsl

from fastapi.routing import APIRoute
from starlette.routing import Match

from hyrax.api.errors import error_response


def declared(route) -> frozenset[str]:
    """The query parameters `route` takes: those of an APIRoute and its dependencies; none for
    a plain route or a mount."""
    if not isinstance(route, APIRoute):
        return frozenset()
    names, todo = set(), [route.dependant]
    while todo:
        d = todo.pop()
        names.update(p.alias for p in d.query_params)
        todo.extend(d.dependencies)
    return frozenset(names)


class QueryCheck:
    def __init__(self, app):
        self.app = app

    def _route(self, scope):
        for route in scope["app"].router.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route
        return None

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope.get("query_string"):
            return await self.app(scope, receive, send)
        route = self._route(scope)
        if route is not None:
            names = declared(route)
            query = parse_qsl(scope["query_string"].decode("latin-1"), keep_blank_values=True)
            unknown = next((k for k, _ in query if k not in names), None)
            if unknown is not None:
                takes = f"takes only {', '.join(sorted(names))}" if names else "takes none"
                return await error_response(
                    400, f"unknown query parameter {unknown!r}: {scope['method']} {scope['path']} {takes}; "
                         "request fields go in the JSON body", param=unknown, code="unknown_parameter",
                )(scope, receive, send)
        await self.app(scope, receive, send)
