"""Bearer-token checks: the admin token for /admin/*, optional API keys for /v1/*.
Tokens are compared in constant time.

The checks are coroutines: FastAPI runs a plain-function dependency in its thread pool, so
every API call would wait for a free worker thread (none while the pool is busy with slow
work) and pay two thread hops for a comparison of a few bytes."""
from __future__ import annotations

import hmac

from fastapi import Request

from hyrax.api.errors import APIError
from hyrax.api.headers import single

CHALLENGE = {"WWW-Authenticate": "Bearer"}  # RFC 9110: a 401 says which scheme to use


def _bearer(request: Request) -> str | None:
    h = single(request, "Authorization") or ""
    if h[:7].lower() == "bearer ":
        return h[7:].strip()
    return None


def _matches(token: str | None, allowed: list[str]) -> bool:
    if token is None:
        return False
    ok = False
    for a in allowed:
        ok |= hmac.compare_digest(token.encode(), a.encode())
    return ok


async def require_admin(request: Request) -> None:
    token = request.app.state.settings.admin_token
    if not token or not _matches(_bearer(request), [token]):
        raise APIError(401, "admin endpoints need `Authorization: Bearer <admin token>`", code="invalid_admin_token",
                       headers=CHALLENGE)


async def require_api_key(request: Request) -> None:
    keys = request.app.state.settings.api_keys
    if keys and not _matches(_bearer(request), list(keys)):
        raise APIError(401, "invalid or missing API key", code="invalid_api_key", headers=CHALLENGE)
