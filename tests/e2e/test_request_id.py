"""`X-Request-Id`: a client names its call, and the same name comes back in the response
header and id and names the call's requests in the admin API (what an operator greps for).
A malformed id is a 400 naming the header; a reused id never makes two requests share one
engine id."""
from __future__ import annotations

import json
import threading

import pytest

from e2e_harness import ADMIN, HTTP, MODEL, assert_error

BODY = {"model": MODEL, "prompt": "hello", "max_tokens": 4}


@pytest.mark.parametrize("stream", [False, True])
def test_the_clients_request_id_names_the_call_everywhere(local, stream):
    r = HTTP.post(f"{local.url}/v1/completions", json={**BODY, "stream": stream, "n": 2},
                   headers={"X-Request-Id": "job-7.a:b_c"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-request-id"] == "job-7.a:b_c"
    first = json.loads(r.text.split("data: ", 2)[1]) if stream else r.json()
    assert first["id"] == "cmpl-job-7.a:b_c"


def test_without_a_request_id_one_is_made_and_returned(local):
    a = HTTP.post(f"{local.url}/v1/chat/completions", timeout=60,
                   json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    b = HTTP.post(f"{local.url}/v1/completions", json=BODY, timeout=60)
    ids = {a.headers["x-request-id"], b.headers["x-request-id"]}
    assert len(ids) == 2 and a.json()["id"] == f"chatcmpl-{a.headers['x-request-id']}"


@pytest.mark.parametrize("path,body,content", [
    ("/v1/completions", {**BODY, "temperature": "hot"}, None),  # pydantic's 400
    ("/v1/completions", {**BODY, "model": "nope"}, None),  # the route's 404
    ("/v1/completions", {**BODY, "echo": True, "logprobs": 1}, None),  # the route's 400
    ("/v1/completions", None, b'{"model": '),  # a body that is not JSON
    ("/v1/chat/completions", {"model": MODEL, "messages": []}, None),
])
def test_an_error_answer_carries_the_calls_request_id(local, path, body, content):
    """A 4xx of a call had no X-Request-Id, its 200 had: the client could not name a failed call."""
    r = HTTP.post(f"{local.url}{path}", json=body, content=content, timeout=60,
                  headers={"X-Request-Id": "failed-7", **({"Content-Type": "application/json"} if content else {})})
    assert 400 <= r.status_code < 500, r.text
    assert r.headers.get("x-request-id") == "failed-7", r.headers
    assigned = HTTP.post(f"{local.url}{path}", json=body, content=content, timeout=60,
                         headers={"Content-Type": "application/json"} if content else {})
    assert assigned.status_code == r.status_code and len(assigned.headers.get("x-request-id", "")) == 32


@pytest.mark.parametrize("bad", ["", "-lead", "has space", "x" * 101, "semi;colon", "slash/"])
def test_a_malformed_request_id_is_400_naming_the_header(local, bad):
    r = HTTP.post(f"{local.url}/v1/completions", json=BODY, headers={"X-Request-Id": bad}, timeout=60)
    assert_error(r, 400, param="X-Request-Id")
    assert "x-request-id" not in r.headers  # the call has no id: not the client's, nor one made up


def test_two_request_ids_in_one_call_are_400_not_one_picked(local):
    """Two X-Request-Id headers: the call ran under the first and the second was dropped unsaid."""
    r = HTTP.post(f"{local.url}/v1/completions", json=BODY, timeout=60,
                  headers=[("X-Request-Id", "first"), ("X-Request-Id", "second")])
    err = assert_error(r, 400, param="X-Request-Id")
    assert "more than once" in err["message"]


def test_admin_lists_the_calls_requests_under_its_id_and_a_reused_id_does_not_collide(local):
    """Two calls in flight with the same id: both run under distinct engine ids, both listed
    under the client's id. Each stream waits for the other to have started before listing."""
    both_streaming, listed = threading.Barrier(2, timeout=60), []

    def stream_one():
        body = {**BODY, "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with HTTP.stream("POST", f"{local.url}/v1/completions", json=body, headers={"X-Request-Id": "same"},
                          timeout=120) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept open: leaving its loop would close the response
            while not next(lines).startswith("data: "):
                pass
            both_streaming.wait()
            listed.append(HTTP.get(f"{local.url}/admin/requests", headers=ADMIN, timeout=30).json()["requests"])
            both_streaming.wait()  # both listings taken before either client leaves

    threads = [threading.Thread(target=stream_one) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert len(listed) == 2
    for requests in listed:
        ids = [x["id"] for x in requests]
        assert len(ids) == 2 and len(set(ids)) == 2 and all(i.startswith("same-0-") for i in ids), ids
