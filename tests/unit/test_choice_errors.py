"""A choice that ends in a replica's error is answered with that error's status and a code of
the same kind: a 500 (the replica could not admit the request: a bug) is a server error, type
`server_error` and code `internal_error` as docs/api.md's table has it, whole or streamed, never
a client error's `invalid_value`. The gateway runs over a scripted replica, so no engine is
needed."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hyrax.actors.engine.step_feed import error_item
from hyrax.actors.model.tokenizer import ByteTokenizer
from hyrax.api.app import GatewaySettings, create_app
from hyrax.api.client import EngineClient, ModelInfo


class FailingReplica:
    role, index = "colocated", 0

    def __init__(self, status: int):
        self.status = status

    def generate(self, request_id, prompt_ids, params):
        async def stream():
            yield error_item("the replica could not admit this request: KeyError: 3", self.status)
        return stream()

    async def health(self) -> dict:
        return {"role": self.role, "replica": self.index, "healthy": True, "stuck": None}


def _gateway(status: int) -> TestClient:
    client = EngineClient(ModelInfo("m", 2048, ByteTokenizer(264, 256), None, 264, (256,)), [FailingReplica(status)])
    app = create_app(client, GatewaySettings(admin_token="t"))
    app.state.ready = True
    return TestClient(app)


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
