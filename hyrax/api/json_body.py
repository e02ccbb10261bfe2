"""Request bodies read as JSON the way RFC 8259 has it over HTTP: UTF-8 only (another declared
charset is a 415, UTF-16 or UTF-32 bytes a 400), uncompressed (a Content-Encoding is a 415), and
nothing silently ignored: a key given twice in one object is a 400 naming it (json.loads would
keep the last), and NaN or Infinity (which Python's parser takes) is a 400. A body the parser cannot take
(a number too long, nesting too deep) is a 400 saying so, not FastAPI's "There was an error
parsing the body". Content-Type given twice is a 400 (`headers.single`). Every router with JSON
bodies uses `JSONRoute`."""
from __future__ import annotations

import json
import sys

from fastapi import Request
from starlette.exceptions import HTTPException  # what FastAPI raises for a body it could not read
from fastapi.routing import APIRoute

from hyrax.api.call_id import call_id, identify
from hyrax.api.errors import APIError
from hyrax.api.headers import single

_UTF8 = ("utf-8", "utf8")


def _invalid(why: str) -> APIError:
    return APIError(400, f"request body is not valid JSON: {why}", code="invalid_json")


def _check_charset(content_type: str) -> None:
    for p in content_type.split(";")[1:]:
        key, _, value = p.partition("=")
        if key.strip().lower() == "charset" and value.strip().strip('"').lower() not in _UTF8:
            raise APIError(415, f"Content-Type declares charset {value.strip()!r}; JSON over HTTP is UTF-8 "
                                "(RFC 8259): send UTF-8, with no charset or charset=utf-8",
                           code="unsupported_media_type")


def _object(pairs: list[tuple]) -> dict:
    """json.loads' object_pairs_hook: a dict, or a 400 for a key given twice."""
    d = dict(pairs)
    if len(d) != len(pairs):
        seen = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise _invalid(f"the key {dup!r} appears twice in one object (Hyrax does not pick one)")
    return d


def _no_constant(name: str):
    """json.loads' parse_constant: NaN, Infinity and -Infinity are JavaScript, not JSON (RFC 8259)."""
    raise _invalid(f"{name} is not a JSON value (JSON numbers are finite; RFC 8259)")


def parse(body: bytes, content_type: str = "") -> object:
    """The JSON value of a request body, or an APIError that says what is wrong with it."""
    if ";" in content_type:
        _check_charset(content_type)
    if b"\x00" in body:  # no UTF-8 JSON text has a NUL byte; UTF-16 and UTF-32 of ASCII do
        raise _invalid("it has NUL bytes (UTF-16 or UTF-32?); JSON over HTTP is UTF-8 (RFC 8259)")
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as e:
        raise _invalid(f"byte 0x{body[e.start]:02x} at offset {e.start} is not UTF-8") from None
    if text[:1] == "\ufeff":  # a UTF-8 byte order mark: RFC 8259 lets a parser ignore it
        text = text[1:]
    try:
        return json.loads(text, object_pairs_hook=_object, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise _invalid(f"{e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise _invalid("it is nested too deeply") from None
    except ValueError as e:  # int(): a number with more digits than Python converts
        if "digits" in str(e):
            raise _invalid(f"an integer has more than {sys.get_int_max_str_digits()} digits") from None
        raise


def _check_encoding(content_encoding: str | None) -> None:
    """A 415 for a body sent with a content coding (gzip, ...): the gateway does not decompress,
    and reading the compressed bytes as JSON would answer a misleading 400 (RFC 9110 §15.5.16)."""
    codings = [c.strip() for c in (content_encoding or "").split(",")]
    if any(c and c.lower() != "identity" for c in codings):
        raise APIError(415, f"Content-Encoding {content_encoding!r} is not supported: send the body uncompressed",
                       param="Content-Encoding", code="unsupported_media_type")


class JSONRequest(Request):
    async def json(self):
        if not hasattr(self, "_json"):
            _check_encoding(single(self, "Content-Encoding"))
            self._json = parse(await self.body(), self.headers.get("content-type", ""))
        return self._json


class JSONRoute(APIRoute):
    """A route whose body is read by `parse`. FastAPI turns an error raised while reading the
    body into its own 400 ("There was an error parsing the body"); the APIError is answered instead.
    A route that declares `Depends(call_id)` has its call id assigned first, before its body is
    read or its dependencies run, so that every error of the call carries it."""

    def get_route_handler(self):
        handler = super().get_route_handler()
        identified = any(d.call is call_id for d in self.dependant.dependencies)

        async def route(request: Request):
            if identified:
                identify(request)
            single(request, "Content-Type")  # before FastAPI picks how to read the body by the first one
            try:
                return await handler(JSONRequest(request.scope, request.receive))
            except HTTPException as e:
                if isinstance(e.__cause__, APIError):
                    raise e.__cause__ from None
                raise

        return route
