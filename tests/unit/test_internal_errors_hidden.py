"""A server-side failure never shows the client what failed inside: a 500 (a route that raised, an
engine that could not admit a request, a stream that failed after it began) answers OpenAI's
shape with a generic message and an id, and the exception's text is in the server log under that
id. 4xx messages, meant for the client, are untouched.

The engine here is a real one behind a real EngineLoop, with `add_request` made to raise; the
mid-stream case runs over a scripted replica that sends what a replica sends on the wire."""
from __future__ import annotations

import json
import logging
import re

import pytest
from fastapi.testclient import TestClient

from engine_helpers import HYBRID, make_engine, tiny_model
from gateway_fakes import Replica, gateway
from hyrax.actors.engine.step_feed import error_item
from hyrax.api.client import LocalBackend

SECRET = "password=hunter2 at /srv/secret/weights.bin"
BODIES = {"/v1/completions": {"model": "m", "prompt": "hi"},
          "/v1/chat/completions": {"model": "m", "messages": [{"role": "user", "content": "hi"}]}}
ID = re.compile(r"request id ([A-Za-z0-9._:-]+)")


@pytest.fixture(scope="module")
def failing_engine():
    """A gateway over an in-process engine loop whose engine raises on every new request."""
    from hyrax.actors.engine.loop import EngineLoop

    engine = make_engine(tiny_model(HYBRID))

    def add_request(*_, **__):
        raise RuntimeError(SECRET)
    engine.add_request = add_request
    loop = EngineLoop(engine, "failing")
    try:
        yield gateway(LocalBackend(loop))
    finally:
        loop.shutdown()


def _assert_hidden(err: dict, caplog) -> None:
    """`err` is a generic internal error whose id the log names, next to the secret."""
    assert SECRET not in json.dumps(err) and "RuntimeError" not in json.dumps(err), err
    assert (err["type"], err["code"]) == ("server_error", "internal_error"), err
    rid = ID.search(err["message"])
    assert rid, err
    lines = [r.getMessage() + (r.exc_text or "") for r in caplog.records]
    assert any(rid.group(1) in line and SECRET in line for line in lines), caplog.text


@pytest.mark.parametrize("path", list(BODIES))
def test_an_engine_error_is_a_500_without_its_text_and_the_log_has_it(path, failing_engine, caplog):
    caplog.set_level(logging.INFO)
    r = failing_engine.post(path, json=BODIES[path], headers={"X-Request-Id": "call-7"})
    assert r.status_code == 500, r.text
    assert SECRET not in r.text, r.text
    _assert_hidden(r.json()["error"], caplog)
    assert "call-7" in r.json()["error"]["message"]  # the id the client gave is findable


@pytest.mark.parametrize("path", list(BODIES))
def test_a_streamed_engine_error_is_a_500_without_its_text(path, failing_engine, caplog):
    """The engine failed before the stream got under way: the answer is the 500 itself."""
    caplog.set_level(logging.INFO)
    r = failing_engine.post(path, json={**BODIES[path], "stream": True})
    assert r.status_code == 500 and SECRET not in r.text, r.text
    _assert_hidden(r.json()["error"], caplog)


class FailsMidway(Replica):
    """Two tokens, then the replica's error (status as given) with an exception's text."""

    def __init__(self, status: int):
        self.status = status

    def generate(self, request_id, prompt_ids, params):
        async def stream():
            yield {"token_ids": [104, 105], "finished": False, "finish_reason": None}
            yield error_item(f"step failed: RuntimeError: {SECRET}", self.status)
        return stream()


@pytest.mark.parametrize("path", list(BODIES))
def test_a_stream_that_fails_midway_sends_no_text_of_the_exception(path, caplog):
    caplog.set_level(logging.INFO)
    r = gateway(FailsMidway(500)).post(path, json={**BODIES[path], "stream": True})
    assert '"hi"' in r.text, r.text  # the tokens before the failure were sent
    assert SECRET not in r.text, r.text
    errors = [json.loads(line[6:])["error"] for line in r.text.splitlines() if line.startswith('data: {"error"')]
    assert len(errors) == 1 and r.text.rstrip().endswith("data: [DONE]"), r.text
    _assert_hidden(errors[0], caplog)


class RaisingStream(Replica):
    """Its stream raises (a transport or actor failure) instead of ending with an error item."""

    def generate(self, request_id, prompt_ids, params):
        async def stream():
            raise ConnectionError(SECRET)
            yield
        return stream()


def _hidden_503(r, caplog) -> None:
    assert r.status_code == 503 and r.headers["Retry-After"] == "1", r.text
    assert SECRET not in r.text and r.json()["error"]["code"] == "unavailable", r.text
    assert SECRET in caplog.text


@pytest.mark.parametrize("path", list(BODIES))
def test_a_replica_stream_that_raises_is_a_503_without_the_exceptions_text(path, caplog):
    caplog.set_level(logging.INFO)
    _hidden_503(gateway(RaisingStream()).post(path, json=BODIES[path]), caplog)


def test_a_replica_that_cannot_recover_tells_its_streams_no_more_than_that(caplog):
    """A step fails and failing the requests fails too: the replica gives up (loop._give_up)."""
    from hyrax.actors.engine.loop import EngineLoop

    caplog.set_level(logging.INFO)
    engine = make_engine(tiny_model(HYBRID))

    def fail(*_, **__):
        raise RuntimeError(SECRET)
    engine.step = engine.fail_all = fail
    loop = EngineLoop(engine, "giving-up")
    try:
        _hidden_503(gateway(LocalBackend(loop)).post("/v1/completions", json={**BODIES["/v1/completions"],
                                                                              "prompt": [1, 2, 3]}), caplog)
    finally:
        loop.shutdown()


class RaisingAdmin(Replica):
    async def run(self, cmd):
        raise RuntimeError(SECRET)


@pytest.mark.parametrize("method,path,body", [("GET", "/admin/requests", None), ("GET", "/admin/pools", None),
                                              ("POST", "/admin/retract", {"all": True}),
                                              ("POST", "/admin/flush-cache", None)])
def test_an_admin_route_that_raises_is_a_500_without_its_text(method, path, body, caplog):
    caplog.set_level(logging.INFO)
    served = TestClient(gateway(RaisingAdmin()).app, raise_server_exceptions=False)  # as uvicorn answers
    r = served.request(method, path, json=body, headers={"Authorization": "Bearer t"})
    assert r.status_code == 500, r.text
    assert SECRET not in r.text, r.text
    _assert_hidden(r.json()["error"], caplog)


def test_a_client_error_keeps_its_message():
    r = gateway(Replica()).post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 5000})
    assert r.status_code == 400 and "exceeds the model's context of 2048 tokens" in r.json()["error"]["message"]
