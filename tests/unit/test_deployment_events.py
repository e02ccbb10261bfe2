"""The deployment controller's event log, as an operator reads it: `GET /admin/events` (admin
token) and `hyrax admin events`. A replica the controller replaced leaves every other view (the
health round lists the replicas serving now), so before this log the only trace of a lost,
down or hung replica was in the controller's memory, reachable from the test helpers alone."""
from __future__ import annotations

import asyncio

import pytest

from gateway_fakes import gateway
from hyrax.cluster import cli
from hyrax.cluster.event_log import DeploymentEvent, EventLog, EventPage


def test_the_log_keeps_the_newest_events_with_their_times_and_counts_every_one():
    now = iter(range(100, 200))
    log = EventLog(keep=3, clock=lambda: float(next(now)))
    for k in range(5):
        log.add(f"event {k}")
    page = log.page()
    assert [(e.at, e.what) for e in page.events] == [(102.0, "event 2"), (103.0, "event 3"), (104.0, "event 4")]
    assert page.as_dict() == {"events": [{"time": 102.0, "event": "event 2"}, {"time": 103.0, "event": "event 3"},
                                         {"time": 104.0, "event": "event 4"}], "total": 5, "dropped": 2}
    assert log.texts() == ["event 2", "event 3", "event 4"]
    with pytest.raises(ValueError):
        EventLog(keep=0)


def _with_events(source):
    http = gateway()
    http.app.state.deployment_events = source
    return http


PAGE = EventPage((DeploymentEvent(1.5, "down colocated/0: its ranks could not be restarted; stopped"),
                  DeploymentEvent(2.5, "replaced a lost colocated replica with colocated/1")), 2)


def test_admin_events_answers_the_controllers_log_to_the_admin_only():
    async def source():
        return PAGE
    http = _with_events(source)
    assert http.get("/admin/events").status_code == 401
    r = http.get("/admin/events", headers={"Authorization": "Bearer t"})
    assert r.status_code == 200, r.text
    assert r.json() == PAGE.as_dict()


def test_admin_events_without_a_controller_or_from_one_that_does_not_answer():
    auth = {"Authorization": "Bearer t"}
    r = gateway().get("/admin/events", headers=auth)  # an in-process engine: no controller
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", r.text

    async def gone():
        raise ConnectionError("the controller's actor died")
    r = _with_events(gone).get("/admin/events", headers=auth)
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert "died" not in r.text  # the cause goes to the log

    async def stuck():
        await asyncio.sleep(60)

    import hyrax.api.admin_routes as routes
    old, routes.EVENTS_TIMEOUT_S = routes.EVENTS_TIMEOUT_S, 0.1
    try:
        assert _with_events(stuck).get("/admin/events", headers=auth).status_code == 503
    finally:
        routes.EVENTS_TIMEOUT_S = old


def test_hyrax_admin_events_calls_the_route(tmp_path, monkeypatch, capsys):
    import httpx

    asked = []

    def answer(method, url, **kw):
        asked.append((method, url))
        return httpx.Response(200, json=PAGE.as_dict())
    monkeypatch.setattr(httpx, "request", answer)
    f = tmp_path / "tok"
    f.write_text("abc\n")
    assert cli.main(["admin", "--token-file", str(f), "events"]) == 0
    assert asked == [("GET", "http://127.0.0.1:8000/admin/events")]
    assert "replaced a lost colocated replica" in capsys.readouterr().out
