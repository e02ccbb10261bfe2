"""The admin API's request selectors (retract, resume): a request id named twice in one call is a
400 naming it. It was looked up twice (`unknown requests: x, x`), and a known one was retracted
by the first mention and reported by the second as not running. The gateway runs over a replica
that knows no request, so no engine is needed."""
from __future__ import annotations

import pytest

from gateway_fakes import gateway

ADMIN = {"Authorization": "Bearer t"}


@pytest.fixture
def http():
    return gateway()


@pytest.mark.parametrize("path", ["/admin/retract", "/admin/resume"])
def test_a_request_id_named_twice_is_a_400_naming_it(http, path):
    r = http.post(path, json={"request_ids": ["a", "x", "b", "x"]}, headers=ADMIN)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["code"], err["param"]) == ("invalid_value", "request_ids"), err
    assert "'x'" in err["message"] and "twice" in err["message"], err
