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
def test_a_streamed_choice_that_failed_ends_with_an_error_event_of_its_status(path, status, kind, code):
    r = _gateway(status).post(path, json={**BODIES[path], "stream": True})
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
