"""Every admin endpoint needs the admin bearer token: without it, or with a wrong one, the
answer is 401 and nothing changes; with it, the call goes through."""
from __future__ import annotations

import base64
import threading

import httpx
import pytest

from e2e_harness import ADMIN, ADMIN_TOKEN, HTTP, MODEL, admin_requests, assert_error, routes, wait_until

WRONG = [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": f"Bearer {ADMIN_TOKEN}x"},
    {"Authorization": f"Bearer {ADMIN_TOKEN[:-1]}"},
    {"Authorization": ADMIN_TOKEN},
    {"Authorization": f"Basic {base64.b64encode(f'admin:{ADMIN_TOKEN}'.encode()).decode()}"},
    {"Authorization": "Bearer"},
    {"X-Admin-Token": ADMIN_TOKEN},
]
# a valid body for each POST endpoint, so only the token decides
BODIES = {
    "/admin/retract": {"all": True},
    "/admin/resume": {"request_ids": ["req-none"]},
    "/admin/forced-retraction": {"interval": 3},
    "/admin/migrate": {"request_id": "req-none"},
    "/admin/drain": {"role": "colocated", "replica": 99},  # no such replica: never drains the only one
}


def admin_routes(app) -> list[tuple[str, str]]:
    found = [(m, p) for m, p in routes(app) if p.startswith("/admin")]
    assert {("GET", "/admin/requests"), ("GET", "/admin/pools"), ("GET", "/admin/health"), ("POST", "/admin/retract"),
            ("POST", "/admin/resume"), ("POST", "/admin/forced-retraction")} <= set(found)
    return found


def call(url: str, method: str, path: str, headers: dict) -> httpx.Response:
    return HTTP.request(method, f"{url}{path}", headers=headers, json=BODIES.get(path) if method == "POST" else None,
                         timeout=30)


def test_every_admin_endpoint_rejects_a_missing_or_wrong_token(local):
    for method, path in admin_routes(local.app):
        for headers in WRONG:
            err = assert_error(call(local.url, method, path, headers), 401, code="invalid_admin_token")
            assert err["type"] == "authentication_error"
            assert ADMIN_TOKEN not in err["message"]
    assert local.engine.forced_interval == 0  # the rejected forced-retraction call changed nothing


def test_admin_endpoints_answer_200_with_the_right_token(local):
    assert call(local.url, "GET", "/admin/requests", ADMIN).json() == {"requests": []}
    pools = call(local.url, "GET", "/admin/pools", ADMIN).json()["replicas"]
    assert pools and all(c["used"] == 0 for rep in pools for c in rep["components"].values())
    r = call(local.url, "POST", "/admin/retract", ADMIN)
    assert r.status_code == 200 and r.json()["retracted"] == []
    assert_error(call(local.url, "POST", "/admin/resume", ADMIN), 404, code="request_not_found")
    r = call(local.url, "POST", "/admin/forced-retraction", ADMIN)
    assert r.status_code == 200 and local.engine.forced_interval == 3
    r = HTTP.post(f"{local.url}/admin/forced-retraction", headers=ADMIN, json={"interval": 0})
    assert r.status_code == 200 and local.engine.forced_interval == 0
    for path in ("/admin/migrate", "/admin/drain"):  # their own answers, but never 401
        if ("POST", path) in routes(local.app):
            assert call(local.url, "POST", path, ADMIN).status_code != 401


class Background:
    """One long greedy stream, read in a thread until the test closes it."""

    def __init__(self, url: str, max_tokens: int = 1500):
        self.tokens_seen = 0
        self.closed = threading.Event()
        self._body = {"model": MODEL, "prompt": "keep going", "max_tokens": max_tokens, "temperature": 0,
                      "stream": True, "ignore_eos": True}
        self._url = url
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self):
        with HTTP.stream("POST", f"{self._url}/v1/completions", json=self._body, timeout=120) as r:
            for line in r.iter_lines():
                if self.closed.is_set():
                    return
                self.tokens_seen += line.startswith("data: ")

    def close(self):
        self.closed.set()
        self._thread.join(timeout=30)


@pytest.fixture
def running(local):
    bg = Background(local.url)
    try:
        [req] = wait_until(lambda: [q for q in admin_requests(local.url) if q["state"] == "running"], 30,
                           what="the request to run")
        yield req["id"]
    finally:
        if "req" in locals():  # a request the test left held would never stream again
            HTTP.post(f"{local.url}/admin/resume", headers=ADMIN, json={"request_ids": [req["id"]]})
        bg.close()


def test_rejected_admin_calls_leave_running_requests_alone(local, running):
    def state():
        [q] = admin_requests(local.url)
        return q

    for headers in WRONG:
        assert_error(HTTP.post(f"{local.url}/admin/retract", headers=headers, json={"all": True}), 401)
        assert_error(HTTP.post(f"{local.url}/admin/retract", headers=headers,
                                json={"request_ids": [running], "hold": True}), 401)
        assert_error(HTTP.post(f"{local.url}/admin/forced-retraction", headers=headers, json={"interval": 1}), 401)
    q = state()
    assert q["state"] == "running" and q["retractions"] == 0
    assert local.engine.forced_interval == 0

    r = HTTP.post(f"{local.url}/admin/retract", headers=ADMIN,
                   json={"request_ids": [running], "mode": "host_pool", "hold": True})
    assert r.status_code == 200 and r.json()["retracted"] == [running]
    assert state()["state"] == "retracted"
    for headers in WRONG:
        assert_error(HTTP.post(f"{local.url}/admin/resume", headers=headers, json={"request_ids": [running]}), 401)
    q = state()
    assert q["state"] == "retracted" and q["hold"] is True

    r = HTTP.post(f"{local.url}/admin/resume", headers=ADMIN, json={"request_ids": [running]})
    assert r.status_code == 200 and not str(r.json()["results"][running]).startswith("error")
    wait_until(lambda: state()["state"] == "running" and state()["output_tokens"] > q["output_tokens"], 20,
               what="the resumed request to make progress")


def test_without_a_configured_token_the_admin_api_is_closed(gateway_with):
    url = gateway_with(admin_token=None)
    for headers in WRONG + [{"Authorization": "Bearer None"}, ADMIN]:
        assert_error(HTTP.get(f"{url}/admin/requests", headers=headers), 401)
        assert_error(HTTP.post(f"{url}/admin/retract", headers=headers, json={"all": True}), 401)


def test_api_keys_and_the_admin_token_do_not_open_each_other(local, gateway_with):
    url = gateway_with(api_keys=("k1",))
    assert_error(HTTP.get(f"{url}/admin/requests", headers={"Authorization": "Bearer k1"}), 401)
    assert_error(HTTP.post(f"{url}/admin/retract", headers={"Authorization": "Bearer k1"}, json={"all": True}), 401)
    assert_error(HTTP.get(f"{url}/v1/models", headers=ADMIN), 401)
    assert HTTP.get(f"{url}/admin/requests", headers=ADMIN).status_code == 200
    assert HTTP.get(f"{url}/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200



def test_token_checks_need_no_worker_thread(local):
    """The API-key and admin-token checks, and a call's id, run on the event loop: with every thread of the
    gateway's pool held by slow work (40 plain-function handlers, anyio's default limit), API
    and admin calls still answer at once. Before, each check was a plain function, which FastAPI
    runs in that pool: the calls waited for a free thread."""
    from e2e_harness import Gateway
    from hyrax.api.app import GatewaySettings, create_app

    app = create_app(local.client, GatewaySettings(admin_token=ADMIN_TOKEN, api_keys=("k1",)))
    release, holding, lock = threading.Event(), [0], threading.Lock()

    def hold_a_thread():  # a plain function: FastAPI runs it in the thread pool
        with lock:
            holding[0] += 1
        release.wait(60)
        return {}

    app.add_api_route("/test-hold", hold_a_thread)
    gw = Gateway(app)
    pool = 40  # anyio's default limit on a loop's worker threads
    holders = [threading.Thread(target=lambda: HTTP.get(f"{gw.url}/test-hold", timeout=60)) for _ in range(pool)]
    try:
        for t in holders:
            t.start()
        wait_until(lambda: holding[0] == pool, 30, what="every pool thread held")
        assert HTTP.get(f"{gw.url}/v1/models", headers={"Authorization": "Bearer k1"}, timeout=5).status_code == 200
        assert HTTP.get(f"{gw.url}/admin/requests", headers=ADMIN, timeout=5).status_code == 200
        assert_error(HTTP.get(f"{gw.url}/v1/models", timeout=5), 401)
        key = {"Authorization": "Bearer k1"}  # and a call's id (X-Request-Id), assigned on the event loop too
        r = HTTP.post(f"{gw.url}/v1/completions", headers=key, timeout=10,
                      json={"model": MODEL, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200 and r.headers["X-Request-Id"], r.text
        r = HTTP.post(f"{gw.url}/v1/chat/completions", headers=key, timeout=10,
                      json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.headers["X-Request-Id"], r.text
    finally:
        release.set()
        for t in holders:
            t.join(60)
        gw.close()


# ---- unknown ids and impossible moves: the same contract on retract, resume and migrate ------------
@pytest.mark.parametrize("path", ["/admin/retract", "/admin/resume"])
def test_naming_only_unknown_requests_is_404_like_migrate(local, path):
    for ids in (["nope"], ["nope", "nope-2"]):
        err = assert_error(HTTP.post(f"{local.url}{path}", headers=ADMIN, json={"request_ids": ids}), 404,
                           code="request_not_found", param="request_ids")
        assert all(i in err["message"] for i in ids), err
    assert_error(HTTP.post(f"{local.url}/admin/migrate", headers=ADMIN, json={"request_id": "nope"}), 404,
                 code="request_not_found", param="request_id")
    # a count or `all` names no request: nothing to retract is no error
    assert HTTP.post(f"{local.url}{path}", headers=ADMIN, json={"all": True}).json()["unknown"] == []


def test_a_batch_with_known_and_unknown_ids_answers_per_id_and_lists_the_unknown(local, running):
    r = HTTP.post(f"{local.url}/admin/retract", headers=ADMIN, json={"request_ids": [running, "nope"], "hold": True})
    assert r.status_code == 200, r.text
    assert r.json()["retracted"] == [running] and r.json()["unknown"] == ["nope"]
    assert r.json()["results"]["nope"] == "unknown_request"
    r = HTTP.post(f"{local.url}/admin/resume", headers=ADMIN, json={"request_ids": ["nope", running]})
    assert r.status_code == 200 and r.json()["resumed"] == [running] and r.json()["unknown"] == ["nope"], r.text


def test_migrating_to_the_replica_a_request_is_on_says_so(local, running):
    err = assert_error(HTTP.post(f"{local.url}/admin/migrate", headers=ADMIN, json={
        "request_id": running, "to": {"role": "colocated", "replica": 0}}), 409, code="already_on_replica", param="to")
    assert "already on colocated/0" in err["message"], err
    # without a target, the only replica has no other to move it to
    assert_error(HTTP.post(f"{local.url}/admin/migrate", headers=ADMIN, json={"request_id": running}), 409,
                 code="no_other_replica")
