"""A header the gateway reads as one value, given twice, is a 400 naming it (as X-Request-Id
already was): two Content-Types (application/json then text/plain, or the other way round) or
two Authorization headers used to be read as the first one, silently. The gateway runs over a
replica that is never reached, so no engine is needed."""
from __future__ import annotations

import json

import pytest

from gateway_fakes import gateway

BODY = json.dumps({"model": "m", "prompt": "hi", "max_tokens": 1})


@pytest.fixture
def http():
    return gateway(api_keys=("k",))


def _assert_named(r, header: str):
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_value", header), err
    assert "more than once" in err["message"], err


@pytest.mark.parametrize("types", [("application/json", "text/plain"), ("text/plain", "application/json"),
                                   ("application/json", "application/json")])
def test_two_content_types_are_a_400_naming_the_header(http, types):
    headers = [("Authorization", "Bearer k"), *(("Content-Type", t) for t in types)]
    _assert_named(http.post("/v1/completions", content=BODY, headers=headers), "Content-Type")


@pytest.mark.parametrize("path,token", [("/v1/completions", "k"), ("/admin/flush-cache", "t")])
def test_two_authorization_headers_are_a_400_naming_the_header(http, path, token):
    headers = [("Content-Type", "application/json"), ("Authorization", f"Bearer {token}"),
               ("Authorization", "Bearer other")]
    _assert_named(http.post(path, content=BODY if path.startswith("/v1") else b"{}", headers=headers),
                  "Authorization")


def test_two_request_ids_are_a_400_naming_the_header(http):
    headers = [("Content-Type", "application/json"), ("Authorization", "Bearer k"), ("X-Request-Id", "a"),
               ("X-Request-Id", "b")]
    _assert_named(http.post("/v1/completions", content=BODY, headers=headers), "X-Request-Id")
