"""A route that declares a query parameter takes it; a bad value is the usual 400 naming it (not
FastAPI's 422, nor `query.limit`), and a parameter it does not declare is a 400 naming that one.
The gateway's own routes declare none (tests/e2e/test_error_codes.py); this one is added to a
real gateway to check that the check asks the route what it takes."""
from __future__ import annotations

from gateway_fakes import gateway


def _with_probe():
    client = gateway()

    @client.app.get("/probe")
    async def probe(limit: int = 10):
        return {"limit": limit}
    return client


def test_a_declared_query_parameter_is_taken_and_a_bad_value_is_400_naming_it():
    client = _with_probe()
    assert client.get("/probe?limit=3").json() == {"limit": 3}
    assert client.get("/probe").json() == {"limit": 10}
    r = client.get("/probe?limit=abc")
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("limit", "invalid_value") and err["message"].startswith("limit: "), err
    r = client.get("/probe?limit=3&page=2")
    assert r.status_code == 400 and r.json()["error"]["param"] == "page", r.text
    assert "takes only limit" in r.json()["error"]["message"]
