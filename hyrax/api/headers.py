"""Headers the gateway reads as one value (Content-Type, Authorization, X-Request-Id): given
twice, it is a 400 naming the header, never the first one taken silently."""
from __future__ import annotations

from fastapi import Request

from hyrax.api.errors import APIError


def single(request: Request, name: str) -> str | None:
    """The header's one value, None when absent; a 400 when it is given more than once."""
    given = request.headers.getlist(name)
    if len(given) > 1:
        raise APIError(400, f"{name} is given more than once; give it once", param=name, code="invalid_value")
    return given[0] if given else None
