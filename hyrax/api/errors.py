"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}. No stack trace
ever reaches a client, nor the text of a server-side failure: a 500 says only that the server
failed and under which request id its log has the details (`internal_error`)."""
from __future__ import annotations

import json
import logging
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyrax.api.schemas import UNSUPPORTED_FIELDS

log = logging.getLogger("hyrax.api")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error",
          415: "invalid_request_error", 503: "service_unavailable", 500: "server_error"}  # 500: OpenAI's type
_SOURCES = ("body", "query", "path", "header", "cookie")  # the first part of a FastAPI error's location
_HTTP_CODES = {404: "not_found", 405: "method_not_allowed"}  # Starlette's own errors (no route, wrong method)


class APIError(Exception):
    """An error answer. `code` is required: every error names its code (docs/api.md's table),
    so a client can tell errors apart without parsing the message."""

    def __init__(self, status: int, message: str, *, code: str, param: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def _printable(s: str | None) -> str | None:
    """Lone surrogates (from a client's JSON) escaped, so the error itself encodes as UTF-8."""
    return None if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": _printable(param), "code": code}}


def _is_union_tag(part) -> bool:
    """pydantic names the union member in an error's location ('str', 'list[int]', ...)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none", "list", "dict")
                                      or part[:1].isupper())


def _branch(loc: tuple) -> tuple:
    """The location up to its first union tag: which member of a union the error is in."""
    tag = next((i for i, part in enumerate(loc) if _is_union_tag(part)), None)
    return loc if tag is None else loc[:tag + 1]


def _pick(errors: list[dict]) -> dict:
    """The error to report: an unknown field first, else the most specific (deepest) one. Among
    equally deep ones, the union member that matched the most: the fewest errors, then the one
    that failed furthest along a list (`prompt: [1, "a"]` is a list of token ids with a bad
    item 1, not a list of texts with a bad item 0)."""
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:
        return unknown[0]
    per_branch: dict[tuple, int] = {}
    for e in errors:
        b = _branch(tuple(e.get("loc", ())))
        per_branch[b] = per_branch.get(b, 0) + 1

    def rank(e: dict):
        loc = tuple(e.get("loc", ()))
        return len(loc), -per_branch[_branch(loc)], [p for p in loc if isinstance(p, int)]

    return max(errors, key=rank, default={})


def _at(body, loc: list):
    """The part of the request body at a pydantic error location (union tags skipped)."""
    for part in loc:
        if isinstance(body, dict) and part in body:
            body = body[part]
        elif isinstance(body, list) and isinstance(part, int) and 0 <= part < len(body):
            body = body[part]
    return body


def validation_error(errors: list[dict], body=None) -> JSONResponse:
    """A 400 for pydantic errors; it names the field (`param`) and says what is wrong with it.
    `body`: the parsed request body, to tell a bad key from a bad value."""
    first = _pick(errors)
    kind = first.get("type")
    if kind == "json_invalid":
        return error_response(400, "request body is not valid JSON", code="invalid_json")
    loc = list(first.get("loc", []))
    if loc[:1] and loc[0] in _SOURCES:  # where FastAPI read it: the field's name follows
        loc = loc[1:]
    if not loc and kind == "missing":  # FastAPI reads an empty body as no body
        return error_response(400, "the request body is empty; send a JSON object with Content-Type: "
                              "application/json", code="invalid_json")
    if not loc and kind in ("model_type", "model_attributes_type", "dict_type"):
        # a JSON array or scalar, or a body sent without Content-Type: application/json (which
        # is then not parsed: `curl -d` sends application/x-www-form-urlencoded)
        return error_response(400, "the request body must be a JSON object, sent with Content-Type: application/json",
                              code="invalid_json")
    bad = first.get("input")
    if kind == "string_unicode" and isinstance(bad, str):  # pydantic cannot read text with a lone surrogate
        node = _at(body, loc)
        if isinstance(node, dict) and bad in node:  # a key: no field has such a name
            loc, kind = [*loc, bad], "extra_forbidden"
        else:
            try:
                bad.encode("utf-8")
            except UnicodeEncodeError as e:
                first = {"msg": f"invalid text: lone surrogate {bad[e.start]!r} at character {e.start}"}
    unknown = kind == "extra_forbidden"  # its last element is the client's key, whatever it looks like
    loc = [str(x) for x in loc[:-1] if not _is_union_tag(x)] + [str(x) for x in loc[-1:] if unknown or not _is_union_tag(x)]
    param = ".".join(loc) or None
    if unknown:
        name = loc[-1]
        if name in UNSUPPORTED_FIELDS:
            return error_response(400, f"{param}: not supported by Hyrax ({UNSUPPORTED_FIELDS[name]} is not "
                                  "implemented); remove the field or set it to null", param=param,
                                  code="unsupported_parameter")
        return error_response(400, f"{param}: unknown field; Hyrax rejects fields it does not implement "
                              "(see docs/api.md)", param=param, code="unknown_parameter")
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    return error_response(400, f"{param}: {msg}" if param else msg, param=param, code="invalid_value")


def internal_error(request_id: str, detail: str | None = None) -> APIError:
    """The 500 a client gets for a failure on the server's side: a generic message naming
    `request_id`, the id the server log files it under. `detail` (a replica's error message,
    which may hold an exception's text) is logged here, never sent."""
    if detail is not None:
        log.error("request %s failed on the server: %s", request_id, detail)
    return APIError(500, f"internal error (request id {request_id}); the server log has the details",
                    code="internal_error")


REQUEST_ID_HEADER = "X-Request-Id"


def logged_request_id(request: Request) -> str:
    """The id a failed call is logged under: the API call's (X-Request-Id, set by the OpenAI
    routes as `request.state.call_id`), else a fresh one (admin and other routes)."""
    return getattr(request.state, "call_id", None) or uuid.uuid4().hex


def error_response(status: int, message: str, *, code: str, param=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, code, param), status_code=status, headers=headers)


def _no_route(method: str, path: str) -> str:
    slash = "; paths have no trailing slash" if path.endswith("/") and path != "/" else ""
    return f"no route for {method} {path}{slash} (docs/api.md lists the routes)"


def _identified(request: Request, response: JSONResponse) -> JSONResponse:
    """The error of a call that has an id (call_id.identify) carries it, as its answer would."""
    call_id = getattr(request.state, "call_id", None)
    if call_id is not None:
        response.headers[REQUEST_ID_HEADER] = call_id
    return response


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(request: Request, e: APIError):
        return _identified(request, error_response(e.status, e.message, code=e.code, param=e.param,
                                                   headers=e.headers))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        return _identified(request, validation_error(e.errors(), e.body))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        msg = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
        if e.status_code == 404 and msg == "Not Found":  # Starlette's: no route has the path
            msg = _no_route(request.method, request.url.path)
        return _identified(request, error_response(e.status_code, msg,
                                                   code=_HTTP_CODES.get(e.status_code, "invalid_request")))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        rid = logged_request_id(request)
        log.error("request %s (%s %s) raised", rid, request.method, request.url.path, exc_info=e)
        err = internal_error(rid)
        return error_response(err.status, err.message, code=err.code, headers={REQUEST_ID_HEADER: rid})
