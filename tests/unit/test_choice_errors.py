"""A choice that ends in a replica's error is answered with that error's status and a code of
the same kind: a 500 (the replica could not admit the request: a bug) is a server error, type
`server_error` and code `internal_error` as docs/api.md's table has it, whole or streamed, never
a client error's `invalid_value`; a replica whose stream raised is a 503 to retry. The gateway
runs over a scripted replica, so no engine is needed."""
from __future__ import annotations

import json

import pytest

from gateway_fakes import Replica, gateway
from hyrax.actors.engine.step_feed import error_item


class FailingReplica(Replica):
    def __init__(self, status: int):
        self.status = status

    def generate(self, request_id, prompt_ids, params):
        async def stream():
            yield error_item("the replica could not admit this request: KeyError: 3", self.status)
        return stream()


def _gateway(status: int):
    return gateway(FailingReplica(status))


BODIES = {"/v1/completions": {"model": "m", "prompt": "hi"},
          "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
KINDS = [(500, "server_error", "internal_error"), (503, "service_unavailable", "unavailable"),
         (400, "invalid_request_error", "invalid_value")]


@pytest.mark.parametrize("status,kind,code", KINDS)
@pytest.mark.parametrize("path", list(BODIES))
def test_a_choice_that_failed_is_answered_with_a_code_of_its_status(path, status, kind, code):
    r = _gateway(status).post(path, json=BODIES[path])
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert (err["type"], err["code"]) == (kind, code), err


@pytest.mark.parametrize("status,kind,code", KINDS)
@pytest.mark.parametrize("path", list(BODIES))
def test_a_streamed_choice_that_failed_before_any_token_is_answered_with_its_status(path, status, kind, code):
    """No response had begun: the answer is the error itself, as unstreamed (a 503 with
    Retry-After), not a 200 stream that holds only an error event."""
    r = _gateway(status).post(path, json={**BODIES[path], "stream": True})
    assert r.status_code == status, r.text
    assert r.headers["content-type"].startswith("application/json"), r.headers
    err = r.json()["error"]
    assert (err["type"], err["code"]) == (kind, code), err
    assert (r.headers.get("Retry-After") is not None) == (status == 503), r.headers


class FailingAfterAToken(FailingReplica):
    def generate(self, request_id, prompt_ids, params):
        async def stream():
            yield {"token_ids": [104], "finished": False, "finish_reason": None}
            yield error_item("the replica failed: KeyError: 3", self.status)
        return stream()


@pytest.mark.parametrize("status,kind,code", KINDS)
@pytest.mark.parametrize("path", list(BODIES))
def test_a_streamed_choice_that_failed_after_a_token_ends_with_an_error_event_of_its_status(path, status, kind, code):
    r = gateway(FailingAfterAToken(status)).post(path, json={**BODIES[path], "stream": True})
    assert r.status_code == 200 and '"h"' in r.text, r.text  # the token before the failure was sent
    errors = [json.loads(line[6:])["error"] for line in r.text.splitlines() if line.startswith('data: {"error"')]
    assert [(e["type"], e["code"]) for e in errors] == [(kind, code)], r.text


class RaisingReplica(Replica):
    """Its stream raises (a transport or actor failure) instead of ending with an error item."""

    def generate(self, request_id, prompt_ids, params):
        async def stream():
            raise ConnectionError("the replica went away")
            yield
        return stream()


@pytest.mark.parametrize("path", list(BODIES))
def test_a_replica_whose_stream_raises_is_a_503_not_the_clients_fault(path):
    r = gateway(RaisingReplica()).post(path, json=BODIES[path])
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "unavailable" and r.headers["Retry-After"] == "1", r.text


class FailingFirstChoice(FailingReplica):
    """Choice 0 fails before any token; the others are answered."""

    def generate(self, request_id, prompt_ids, params):
        async def stream():
            if "-0-" in request_id:
                yield error_item("the replica failed: KeyError: 3", self.status)
                return
            yield {"token_ids": [104], "finished": True, "finish_reason": "length"}
        return stream()


def test_a_stream_with_a_choice_under_way_begins_though_another_failed_first():
    """One choice under way is enough for the stream to begin; the failed one ends in it with its
    error event, after its "error" chunk."""
    body = {**BODIES["/v1/completions"], "stream": True, "n": 2}
    r = gateway(FailingFirstChoice(503)).post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    errors = [e["error"] for e in events if "error" in e]
    reasons = {c["index"]: c["finish_reason"] for e in events for c in e.get("choices", []) if c["finish_reason"]}
    assert [x["code"] for x in errors] == ["unavailable"] and reasons == {0: "error", 1: "length"}, r.text
