"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}. No stack trace
ever reaches a client."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from hyrax.api.schemas import UNSUPPORTED_FIELDS

log = logging.getLogger("hyrax.api")

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 409: "conflict_error", 413: "invalid_request_error", 503: "service_unavailable",
          500: "internal_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}


def _printable(s: str | None) -> str | None:
    """Lone surrogates (from a client's JSON) escaped, so the error itself encodes as UTF-8."""
    return None if s is None else s.encode("utf-8", "backslashreplace").decode("utf-8")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": _printable(message), "type": _TYPES.get(status, "invalid_request_error"),
                      "param": _printable(param), "code": code}}


def _is_union_tag(part) -> bool:
    """pydantic names the union member in an error's location ('str', 'list[int]', ...)."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool", "none", "list", "dict")
                                      or part[:1].isupper())


def _pick(errors: list[dict]) -> dict:
    """The error to report: an unknown field first, else the most specific (deepest) one."""
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    return unknown[0] if unknown else max(errors, key=lambda e: len(e.get("loc", ())), default={})


def validation_error(errors: list[dict]) -> JSONResponse:
    """A 400 for pydantic errors; it names the field (`param`) and says what is wrong with it."""
    first = _pick(errors)
    if first.get("type") == "json_invalid":
        return error_response(400, "request body is not valid JSON", None, "invalid_json")
    loc = [x for x in first.get("loc", []) if x != "body"]
    if not loc and first.get("type") in ("model_type", "model_attributes_type", "dict_type"):
        # a JSON array or scalar, or a body sent without Content-Type: application/json (which
        # is then not parsed: `curl -d` sends application/x-www-form-urlencoded)
        return error_response(400, "the request body must be a JSON object, sent with Content-Type: application/json",
                              None, "invalid_json")
    unknown = first.get("type") == "extra_forbidden"  # its last element is the client's key, whatever it looks like
    loc = [str(x) for x in loc[:-1] if not _is_union_tag(x)] + [str(x) for x in loc[-1:] if unknown or not _is_union_tag(x)]
    param = ".".join(loc) or None
    if unknown:
        name = loc[-1]
        if name in UNSUPPORTED_FIELDS:
            return error_response(400, f"{param}: not supported by Hyrax ({UNSUPPORTED_FIELDS[name]} is not "
                                  "implemented); remove the field or set it to null", param, "unsupported_parameter")
        return error_response(400, f"{param}: unknown field; Hyrax rejects fields it does not implement "
                              "(see docs/api.md)", param, "unknown_parameter")
    msg = first.get("msg", "invalid request").removeprefix("Value error, ")
    return error_response(400, f"{param}: {msg}" if param else msg, param, "invalid_value")


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        return validation_error(e.errors())

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        if isinstance(e.__cause__, UnicodeDecodeError):  # FastAPI's 400 for a body that is no UTF-8
            bad = e.__cause__
            return error_response(400, f"request body is not valid JSON: byte 0x{bad.object[bad.start]:02x} at "
                                  f"offset {bad.start} is not UTF-8", None, "invalid_json")
        msg = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
        return error_response(e.status_code, msg)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal error; see the server log", None, "internal_error")
