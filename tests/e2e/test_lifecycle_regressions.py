"""Request-lifecycle regressions (issue 14), each over the HTTP gateway with in-process
engines: the colocated stack, or a prefill + decode pair that hands requests off with the
same offer/import/acknowledge protocol as over Ray.

Garbage collection is off during these tests: whether an abandoned request is freed must
not depend on when a suspended generator happens to be collected (the old flaky disconnect
test failed exactly when it was not)."""
from __future__ import annotations

import gc
import socket
import threading
import time

import httpx
import pytest

from e2e_harness import ADMIN, E2E_CONFIG, HTTP, MODEL, admin_requests, assert_error, wait_until
from pd_local_harness import local_pd_gateway

LONG = 400  # tokens: far more than is generated before a disconnect is noticed
VERY_LONG = 1900  # the demo model's context (2,048) less the prompt: seconds of decoding


@pytest.fixture(autouse=True)
def no_gc():
    gc.collect()
    gc.disable()
    yield
    gc.enable()


@pytest.fixture(scope="module")
def pd():
    import torch

    torch.set_num_threads(1)
    with local_pd_gateway(E2E_CONFIG) as stack:
        yield stack


@pytest.fixture
def pd_clean(pd):
    yield pd
    wait_until(pd.clean, 20, what="both replicas idle with empty pools")
    for lp in pd.loops:
        assert lp.check_invariants() and lp.invariant_error is None


def _body(stream: bool, max_tokens: int = LONG, **kw) -> dict:
    return {"model": MODEL, "prompt": "t567;e03627;b86334;u8890;d97427?b", "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": stream, **kw}


def _vanish_after(url: str, chunks: int) -> None:
    """A streaming client that reads `chunks` data events and closes the connection."""
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/completions", json=_body(True)) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            seen = 0
            while seen < chunks:
                seen += next(lines).startswith("data: ")


def _vanish_without_reading(url: str, path: str, body: dict, leave: threading.Event) -> None:
    """Send a request on a raw socket, wait until told to leave, and close it without reading
    the answer."""
    import json

    raw = json.dumps(body).encode()
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as s:
        s.sendall(f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {len(raw)}\r\n\r\n".encode() + raw)
        leave.wait(30)


def _served(url: str) -> dict:
    r = HTTP.post(f"{url}/v1/completions", json=_body(False, max_tokens=8), timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.parametrize("chunks", [0, 1, 2, 5])
def test_streams_dropped_after_n_chunks_leave_nothing_allocated_under_pd(pd_clean, chunks):
    """Item 1: dropped right after the first chunk, the request was mid hand-off (offered by
    the prefill replica) and leaked there forever."""
    pd = pd_clean
    for _ in range(6):
        _vanish_after(pd.url, chunks)
    wait_until(pd.clean, 20, what="every dropped request to be freed on both replicas")
    assert admin_requests(pd.url) == []
    assert _served(pd.url)["choices"][0]["finish_reason"] == "length"  # and the server still serves


def test_non_streaming_client_that_disconnects_is_aborted(pd_clean):
    """Item 2: a non-streaming request whose client went away ran on to max_tokens."""
    pd = pd_clean
    before = sum(lp.engine.stats.finished["abort"] for lp in pd.loops)
    leave = threading.Event()
    # the client leaves once its request runs (after a fixed delay, a fast engine had finished
    # all LONG tokens before the disconnect was noticed)
    body = _body(False, max_tokens=VERY_LONG)
    t = threading.Thread(target=_vanish_without_reading, args=(pd.url, "/v1/completions", body, leave))
    t.start()
    try:
        wait_until(lambda: any(q["state"] == "running" for q in admin_requests(pd.url)), 20, what="the request to run")
    finally:
        leave.set()
        t.join()
    wait_until(pd.clean, 20, what="the abandoned request to be aborted")
    assert sum(lp.engine.stats.finished["abort"] for lp in pd.loops) == before + 1
    rec = list(pd.client.requests.values())[-1]
    assert rec["finish_reason"] is None and len(rec["tokens"]) < VERY_LONG


def test_no_decode_replica_answers_503_with_retry_after_and_leaks_nothing(pd_clean):
    """Item 3: with the decode replica drained, completions answered 200 with
    finish_reason "error" (leaking a hand-off each time)."""
    pd = pd_clean
    r = HTTP.post(f"{pd.url}/admin/drain", headers=ADMIN, json={"role": "decode", "replica": 0}, timeout=60)
    assert r.status_code == 200, r.text
    try:
        for stream in (False, True):
            resp = HTTP.post(f"{pd.url}/v1/completions", json=_body(stream, max_tokens=4), timeout=60)
            err = assert_error(resp, 503, code="unavailable")
            assert "no decode replica accepts requests" in err["message"], err  # says why, not just "not ready"
            assert resp.headers.get("retry-after")
        # a health check while drained records "not ready"; the undrain below must clear it at
        # once (it used to last until the next health poll: a 503 for a request that can be served)
        assert HTTP.get(f"{pd.url}/health", timeout=60).status_code == 503
        assert pd.clean()
    finally:
        HTTP.post(f"{pd.url}/admin/drain", headers=ADMIN, timeout=60,
                   json={"role": "decode", "replica": 0, "undrain": True})
    assert _served(pd.url)["choices"][0]["finish_reason"] == "length"


def test_one_request_asking_for_more_choices_than_the_cap_is_400(local):
    """Item 4: 1000 prompts x n=16 became 16,000 engine requests."""
    body = {"model": MODEL, "prompt": ["a b"] * 1000, "n": 16, "max_tokens": 1}
    err = assert_error(HTTP.post(f"{local.url}/v1/completions", json=body, timeout=60), 400, code="too_many_choices")
    assert "16000" in err["message"] and str(local.client.max_choices) in err["message"]
    assert local.is_idle()


def test_the_inflight_limit_counts_choices_not_http_requests(local):
    inner = local.client._inner
    old = inner.max_inflight
    inner.max_inflight = 7
    held = inner.reserve(2)  # another call's two choices in flight
    try:
        body = {"model": MODEL, "prompt": ["a b", "c d", "e f"], "n": 2, "max_tokens": 1}  # 6 choices
        resp = HTTP.post(f"{local.url}/v1/completions", json=body, timeout=60)
        assert_error(resp, 503, code="unavailable")
        assert resp.headers.get("retry-after")
        body["n"] = 1  # 3 choices fit
        assert HTTP.post(f"{local.url}/v1/completions", json=body, timeout=60).status_code == 200
    finally:
        held.release_all()
        inner.max_inflight = old
    assert inner.admitted == 0


def test_resume_takes_the_same_selectors_as_retract_and_admin_count_takes_the_last_request(local):
    """Item 9: resume took only ids; `retract {"count": 1}` with one running request
    retracted nothing."""
    done = threading.Event()

    def one_stream():
        with httpx.Client(timeout=120) as http:
            r = http.post(f"{local.url}/v1/completions", json=_body(False, max_tokens=150))
            assert r.status_code == 200, r.text
        done.set()

    t = threading.Thread(target=one_stream)
    t.start()
    wait_until(lambda: any(q["state"] == "running" for q in admin_requests(local.url)), 30, what="a running request")
    r = HTTP.post(f"{local.url}/admin/retract", headers=ADMIN, json={"count": 1, "hold": True}, timeout=30)
    assert r.status_code == 200 and len(r.json()["retracted"]) == 1, r.text
    rid = r.json()["retracted"][0]
    assert [q["state"] for q in admin_requests(local.url)] == ["retracted"]
    time.sleep(0.3)
    assert not done.is_set()  # held: nothing resumes it behind the operator's back
    r = HTTP.post(f"{local.url}/admin/resume", headers=ADMIN, json={"all": True}, timeout=30)
    assert r.status_code == 200 and r.json()["resumed"] == [rid], r.text
    t.join(timeout=120)
    assert done.is_set()


def test_a_stuck_replica_makes_health_not_ready_with_the_reason(local):
    """Work queued, nothing running, no progress: /health says so (it said ready while
    leaked slots made every new request hang), and /admin/health says what the replica reported."""
    engine, loop = local.engine, local.loop
    loop.stuck_after_s = 0.3
    # the idle pool check would catch the planted leak first (if the replica's idle period ends
    # just then) and its sticky invariant error would stand for every later test: off meanwhile
    idle_check, loop.idle_check_after_s = loop.idle_check_after_s, float("inf")
    slots = engine.alloc["mamba_ssm"]
    with loop.lock:
        leaked = slots.allocate("leak", slots.num_free)  # as a leak would: no slot left
    t = threading.Thread(target=lambda: HTTP.post(f"{local.url}/v1/completions", json=_body(False, max_tokens=2),
                                                   timeout=60))
    t.start()
    try:
        wait_until(lambda: HTTP.get(f"{local.url}/health", timeout=10).status_code == 503, 20, what="not ready")
        err = HTTP.get(f"{local.url}/health", timeout=10).json()["error"]
        assert "colocated/0: stuck" in err["message"], err  # the state, publicly; the replica's words
        detail = HTTP.get(f"{local.url}/admin/health", headers=ADMIN, timeout=10).json()  # for the operator
        assert not detail["ready"] and "waiting" in detail["reasons"][0], detail
    finally:
        with loop.lock:
            slots.free("leak", leaked)
        loop.stuck_after_s = 30.0
        loop.idle_check_after_s = idle_check
    t.join(timeout=60)
    wait_until(lambda: HTTP.get(f"{local.url}/health", timeout=10).status_code == 200, 20, what="ready again")


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_disconnect_mid_stream_is_noticed_without_garbage_collection(local, path):
    """Item 11: the stream's generator was closed only when collected; with a cycle holding
    it, the abandoned request ran on."""
    from e2e_harness import disconnect_mid_stream, finished_count

    for _ in range(3):
        before = finished_count(local.loop.stats(), "abort")
        disconnect_mid_stream(local.url, path, 1)
        wait_until(local.loop.is_idle_clean, 20, what="the engine to drop the abandoned request")
        assert finished_count(local.loop.stats(), "abort") == before + 1


def test_migrate_names_only_a_replica_that_can_decode(pd_clean):
    """An attack session moved a decoding request to the prefill replica with an explicit
    `to`: the gateway accepted it, the prefill replica (which never decodes) kept the request
    and its pool units with no progress and no error for as long as the client waited. A
    target must be a replica that decodes: a 400 naming it, and the request goes on where it
    was."""
    pd = pd_clean
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=HTTP.post(
        f"{pd.url}/v1/completions", json=_body(False, max_tokens=VERY_LONG), timeout=120)))
    t.start()
    try:
        wait_until(lambda: any(q["state"] == "running" and q["role"] == "decode" for q in admin_requests(pd.url)),
                   30, what="the request to decode")
        rid = admin_requests(pd.url)[0]["id"]
        resp = HTTP.post(f"{pd.url}/admin/migrate", headers=ADMIN, timeout=60,
                         json={"request_id": rid, "to": {"role": "prefill", "replica": 0}})
        err = assert_error(resp, 400, code="invalid_value", param="to.role")
        assert "prefill/0" in err["message"] and "decode" in err["message"], err
    finally:
        t.join()
    assert out["r"].status_code == 200, out["r"].text  # it went on decoding where it was
    assert out["r"].json()["choices"][0]["finish_reason"] == "length"
