"""The deployment controller's event log, as an operator reads it: `GET /admin/events` (admin
token) and `hyrax admin events`. A replica the controller replaced leaves every other view (the
health round lists the replicas serving now), so before this log the only trace of a lost,
down or hung replica was in the controller's memory, reachable from the test helpers alone."""
from __future__ import annotations

import asyncio

import pytest

from gateway_fakes import gateway
from hyrax.cluster import cli
from hyrax.cluster.event_log import KINDS, DeploymentEvent, EventLog, EventPage


def test_the_log_keeps_the_newest_events_with_their_times_and_counts_every_one_by_kind():
    now = iter(range(100, 200))
    log = EventLog(keep=3, clock=lambda: float(next(now)))
    for k, kind in enumerate(("dead", "replaced", "down", "replaced", "added")):
        log.add(kind, f"event {k}")
    page = log.page()
    assert [(e.at, e.what) for e in page.events] == [(102.0, "event 2"), (103.0, "event 3"), (104.0, "event 4")]
    answer = page.as_dict()
    assert answer["events"] == [{"time": 102.0, "kind": "down", "event": "event 2"},
                                {"time": 103.0, "kind": "replaced", "event": "event 3"},
                                {"time": 104.0, "kind": "added", "event": "event 4"}]
    assert (answer["total"], answer["dropped"]) == (5, 2)
    assert answer["counts"] == {**dict.fromkeys(KINDS, 0), "dead": 1, "replaced": 2, "down": 1, "added": 1}
    assert log.texts() == ["event 2", "event 3", "event 4"]
    with pytest.raises(ValueError, match="unknown deployment event kind 'lost'"):
        log.add("lost", "a kind no dashboard counts")
    with pytest.raises(ValueError):
        EventLog(keep=0)


def _with_events(source):
    http = gateway()
    http.app.state.deployment_events = source
    return http


PAGE = EventPage((DeploymentEvent(1.5, "down", "down colocated/0: its ranks could not be restarted; stopped"),
                  DeploymentEvent(2.5, "replaced", "replaced a lost colocated replica with colocated/1")), 2,
                 tuple({**dict.fromkeys(KINDS, 0), "down": 1, "replaced": 1}.items()))


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

    import hyrax.api.deployment_events as events
    old, events.TIMEOUT_S = events.TIMEOUT_S, 0.1
    try:
        assert _with_events(stuck).get("/admin/events", headers=auth).status_code == 503
    finally:
        events.TIMEOUT_S = old


def _exposition(families) -> str:
    from prometheus_client import CollectorRegistry, generate_latest

    from hyrax.api.metrics import _Snapshot

    reg = CollectorRegistry()
    reg.register(_Snapshot(families))
    return generate_latest(reg).decode()


def test_metrics_count_the_controllers_events_by_kind_and_go_on_without_them():
    """What /metrics adds to its scrape (hyrax.api.metrics.render): every kind, so that a rate()
    starts at 0; nothing from a controller that does not answer, or where there is none."""
    from hyrax.api.metrics import _events

    async def source():
        return PAGE
    text = _exposition(asyncio.run(_events(source)))
    assert 'hyrax_deployment_events_total{kind="down"} 1.0' in text, text
    assert 'hyrax_deployment_events_total{kind="replaced"} 1.0' in text
    assert 'hyrax_deployment_events_total{kind="hung"} 0.0' in text

    async def gone():
        raise ConnectionError("the controller's actor died")
    assert asyncio.run(_events(gone)) == [] and asyncio.run(_events(None)) == []


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


def test_the_gateways_metrics_route_adds_the_controllers_counters():
    from test_admin_views_replica_gone import Answering

    async def source():
        return PAGE
    http = gateway(replicas=[Answering(0)])
    http.app.state.deployment_events = source
    text = http.get("/metrics").text
    assert 'hyrax_deployment_events_total{kind="down"} 1.0' in text and "hyrax_replica_healthy" in text, text

