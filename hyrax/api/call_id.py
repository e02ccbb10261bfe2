"""An API call's id (`X-Request-Id`): the client's when given, so that the client, the admin API
and the logs name the same request, else a fresh one. A route that has one declares
`Depends(call_id)`; `JSONRoute` then assigns it before it reads the body, so every answer of
the call carries it, errors included (errors.install_handlers). Choice k of the call runs as
engine request `<id>-<k>-<nonce>`: a client may reuse an id (or two clients pick the same) while
the first call's requests are still being aborted, and two requests must never share one engine
id."""
from __future__ import annotations

import re
import uuid

from fastapi import Request

from hyrax.api.errors import REQUEST_ID_HEADER, APIError
from hyrax.api.headers import single

_REQUEST_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,99}")


def identify(request: Request) -> str:
    """The call's id, assigned once per call (`request.state.call_id`); a malformed or repeated
    X-Request-Id is a 400 naming the header, answered with no id."""
    assigned = getattr(request.state, "call_id", None)
    if assigned is not None:
        return assigned
    given = single(request, REQUEST_ID_HEADER)
    if given is not None and not _REQUEST_ID.fullmatch(given):
        raise APIError(400, f"{REQUEST_ID_HEADER} must be 1-100 characters of A-Z a-z 0-9 . _ : - "
                            "starting with a letter or digit", param=REQUEST_ID_HEADER, code="invalid_value")
    request.state.call_id = given or uuid.uuid4().hex  # what an internal error is logged under (errors.py)
    return request.state.call_id


async def call_id(request: Request) -> str:
    """`identify` as a route's dependency: a coroutine, so it runs on the event loop (FastAPI runs
    a plain-function dependency in its worker-thread pool: two thread hops per call, and a wait
    for a free thread while the pool is busy)."""
    return identify(request)
