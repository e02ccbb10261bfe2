"""The gateway checks a request's grammar (which compiles it: seconds for a schema of thousands of
properties) off its event loop, so other clients' requests are answered meanwhile. Before, the
check ran on the event loop and every other request, /v1/models and /health included, waited."""
from __future__ import annotations

import threading
import time

import pytest

from gateway_fakes import gateway

CHECK_SECONDS = 1.5

SCHEMA_BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4,
               "response_format": {"type": "json_schema", "json_schema": {"name": "slow", "schema": {
                   "type": "object", "properties": {"slow_to_compile": {"type": "integer"}}}}}}
TOOL_BODY = {"model": "m", "messages": [{"role": "user", "content": "x"}], "max_tokens": 4, "tool_choice": "required",
             "tools": [{"type": "function", "function": {"name": "f", "parameters": {
                 "type": "object", "properties": {"slow_tool": {"type": "integer"}}}}}]}


@pytest.mark.parametrize("path,body", [("/v1/chat/completions", SCHEMA_BODY), ("/v1/chat/completions", TOOL_BODY),
                                       ("/v1/completions", {**{k: v for k, v in SCHEMA_BODY.items() if k != "messages"},
                                                            "prompt": "x"})])
def test_other_requests_are_answered_while_a_grammar_is_checked(monkeypatch, path, body):
    import hyrax.actors.engine.grammar as grammar

    def slow_compile(g):  # a heavy compile: holds its thread, and refuses the grammar in the end
        time.sleep(CHECK_SECONDS)
        raise RuntimeError("too slow to be true")
    monkeypatch.setattr(grammar, "_compile_check", slow_compile)
    with gateway() as c:
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=c.post(path, json=body)))
        t.start()
        time.sleep(0.3)  # the check is under way
        start = time.monotonic()
        assert c.get("/v1/models").status_code == 200
        waited = time.monotonic() - start
        t.join()
    assert answer["r"].status_code == 400 and "too slow to be true" in answer["r"].json()["error"]["message"]
    assert waited < CHECK_SECONDS / 2, f"/v1/models waited {waited:.2f} s for another request's grammar check"
