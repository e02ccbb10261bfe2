"""`GET /health` is unauthenticated (Kubernetes probes, load balancers): it answers readiness and
each replica's state, never a replica's last error (exception text, addresses, pids). That
detail is the operator's, at `GET /admin/health` behind the admin token.

The replicas here are scripted: each answers the health dict a coordinator answers, with a
secret-looking last error."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from gateway_fakes import Replica
from hyrax.actors.model.tokenizer import ByteTokenizer
from hyrax.api.app import GatewaySettings, create_app
from hyrax.api.client import EngineClient, ModelInfo

SECRET = "ActorDiedError: worker 10.0.0.7:36211 pid=4242 token=hunter2"
LEAKS = (SECRET, "ActorDiedError", "10.0.0.7", "4242", "hunter2")
ADMIN = {"Authorization": "Bearer t"}


class Answering(Replica):
    """A replica whose health answer is `answer` (over its role and index)."""

    def __init__(self, index: int, answer: dict):
        self.index, self.answer = index, answer

    async def health(self) -> dict:
        return {"role": self.role, "replica": self.index, **self.answer}


HEALTHY = {"healthy": True, "down": False, "stuck": None, "restarts": 0, "last_error": None}
FAILED = {  # how the replica fails: its health answer, and the state /health names
    "unhealthy": {"healthy": False, "down": False, "stuck": None, "restarts": 1, "last_error": SECRET},
    "restarting": {"healthy": False, "down": False, "restarting": True, "stuck": None, "restarts": 2,
                   "last_error": f"restart 2 failed: {SECRET}"},
    "down": {"healthy": False, "down": True, "stuck": None, "restarts": 3,
             "last_error": f"replica down after 3 rank restarts within 600 s; {SECRET}"},
    "stuck": {"healthy": True, "down": False, "stuck": f"pool invariant violated: {SECRET}", "restarts": 0,
              "last_error": None},
}


def _gateway(replicas: list) -> TestClient:
    """A gateway over `replicas`, admin token "t"."""
    info = ModelInfo("m", 2048, ByteTokenizer(264, 256), None, 264, (256,))
    return TestClient(create_app(EngineClient(info, replicas), GatewaySettings(admin_token="t")))


def _served(*answers: dict) -> TestClient:
    """A gateway over colocated replicas 0.. answering `answers`."""
    return _gateway([Answering(i, a) for i, a in enumerate(answers)])


def _assert_no_leak(text: str) -> None:
    for leak in LEAKS:
        assert leak not in text, f"{leak!r} in {text}"


@pytest.mark.parametrize("state", list(FAILED))
def test_health_while_ready_names_the_failed_replicas_state_but_not_its_error(state):
    r = _served(FAILED[state], HEALTHY).get("/health")
    assert r.status_code == 200, r.text  # colocated/1 still serves
    _assert_no_leak(r.text)
    body = r.json()
    assert body["status"] == "ok" and body["ready"] is True, body
    first, second = body["replicas"]
    assert (first["role"], first["replica"], first["state"], first["in_service"]) == ("colocated", 0, state, False)
    assert (second["state"], second["in_service"]) == ("healthy", True), second
    assert first["restarts"] == FAILED[state]["restarts"], first
    assert body["reasons"] == [f"colocated/0: {state}"], body


@pytest.mark.parametrize("state", list(FAILED))
def test_health_while_not_ready_is_a_503_naming_each_replica_out_and_its_state_but_not_its_error(state):
    r = _served(FAILED[state]).get("/health")
    assert r.status_code == 503 and r.headers["Retry-After"] == "5", r.text
    _assert_no_leak(r.text)
    err = r.json()["error"]
    assert err["code"] == "unavailable" and f"colocated/0: {state}" in err["message"], err


def test_a_generation_refused_while_not_ready_does_not_show_the_replicas_error():
    """Requests refused because the last health check found no replica ready say why with the
    same public words as /health."""
    served = _served(FAILED["down"])
    assert served.get("/health").status_code == 503  # the check that finds it down
    r = served.post("/v1/completions", json={"model": "m", "prompt": "hi"})
    assert r.status_code == 503 and r.headers["Retry-After"], r.text
    _assert_no_leak(r.text)
    assert "colocated/0: down" in r.json()["error"]["message"], r.text


def test_an_unanswered_health_check_shows_no_exception_text():
    class Raising(Replica):
        async def health(self):
            raise ConnectionError(SECRET)

    r = _gateway([Raising(), Answering(1, HEALTHY)]).get("/health")
    _assert_no_leak(r.text)
    first = r.json()["replicas"][0]
    assert (first["state"], first["in_service"], first["missed_checks"]) == ("unresponsive", True, 1), first


@pytest.mark.parametrize("state", list(FAILED))
def test_admin_health_shows_the_replicas_error_to_the_operator(state):
    served = _served(FAILED[state], HEALTHY)
    r = served.get("/admin/health", headers=ADMIN)
    assert r.status_code == 200, r.text
    body = r.json()
    assert SECRET in r.text and body["ready"] is True, body
    first = body["replicas"][0]
    assert first["state"] == state and first["health"] == {"role": "colocated", "replica": 0, **FAILED[state]}
    assert SECRET in body["reasons"][0] and body["reasons"][0].startswith("colocated/0: "), body


def test_admin_health_answers_200_when_not_ready():
    """The operator's view is not a probe: it answers what it found, ready or not."""
    r = _served(FAILED["down"]).get("/admin/health", headers=ADMIN)
    assert r.status_code == 200 and r.json()["ready"] is False and SECRET in r.text, r.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": "t"}])
def test_admin_health_refuses_without_the_admin_token(headers):
    r = _served(FAILED["down"]).get("/admin/health", headers=headers)
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_admin_token", r.text
    _assert_no_leak(r.text)


def test_a_coordinator_replacing_its_ranks_reports_itself_restarting():
    """What makes the state `restarting` rather than `unhealthy`: the coordinator says so while
    it replaces its ranks (not down, its loop not closed)."""
    from hyrax.actors.coordinator import RoleCoordinator

    health = RoleCoordinator.__ray_metadata__.modified_class.health
    coord = SimpleNamespace(role="colocated", replica=0, healthy=False, down=False, restarts=1, last_error=SECRET,
                            tp_size=1, loop=SimpleNamespace(stuck_reason=lambda: None, stopping=False),
                            gateways=SimpleNamespace(summary=lambda: {}), feeds=SimpleNamespace(summary=lambda: {}),
                            device="cpu", attention_backend="sdpa",
                            memory=[], executor=SimpleNamespace(step_path="plain"), rank_heaps=[])
    assert health(coord)["restarting"] is True
    coord.healthy = True
    assert health(coord)["restarting"] is False
    coord.healthy, coord.down = False, True
    assert health(coord)["restarting"] is False
    coord.down, coord.loop.stopping = False, True  # its loop gave up: unhealthy, not restarting
    assert health(coord)["restarting"] is False
