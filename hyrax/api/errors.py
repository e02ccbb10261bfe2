"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}}. No stack trace
ever reaches a client."""
from __future__ import annotations

import json
import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

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


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param=None, code=None, headers=None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.code, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError):
        errs = e.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", []) if x != "body"]
        if first.get("type") == "json_invalid":
            return error_response(400, "request body is not valid JSON", None, "invalid_json")
        msg = first.get("msg", "invalid request")
        param = ".".join(loc) or None
        return error_response(400, f"{param}: {msg}" if param else msg, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException):
        msg = e.detail if isinstance(e.detail, str) else json.dumps(e.detail)
        return error_response(e.status_code, msg)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception):
        log.exception("unhandled error")
        return error_response(500, "internal error; see the server log", None, "internal_error")
