"""A stream whose choice fails after it began (its replica failed, its hand-off found no
decode replica): the client got a chunk with finish_reason "error" and nothing saying what
happened. Now an error event follows that chunk, OpenAI-shaped (OpenAI's Python client
raises it), before usage and `data: [DONE]`; the request is freed on the replica."""
from __future__ import annotations

import json

import httpx
import pytest

from e2e_harness import MODEL, RecordingClient, wait_until
from gateway_harness import Gateway

FAIL_AFTER = 3  # tokens


class FailsMidStream(RecordingClient):
    """The real engine client, with the replica failing after FAIL_AFTER tokens of a stream
    (the item the client makes when a replica's stream stops short)."""

    async def generate(self, request_id, prompt_ids, params):
        n = 0
        async for item in self._inner.generate(request_id, prompt_ids, params):
            yield item
            n += len(item.get("token_ids", []))
            if n >= FAIL_AFTER:
                break  # leaving the real stream aborts the request on its replica
        yield {"error": "the replica serving this request stopped before the request finished", "status": 503,
               "finished": True, "finish_reason": "error", "token_ids": []}


@pytest.fixture
def failing_gateway(local_stack):
    from hyrax.api.app import GatewaySettings, create_app

    gw = Gateway(create_app(FailsMidStream(local_stack.client), GatewaySettings(admin_token="t")))
    yield gw
    gw.close()


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_choice_that_fails_mid_stream_ends_with_an_error_event(local, failing_gateway, path):
    body = {"model": MODEL, "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    body |= {"prompt": "t567;e03627"} if "chat" not in path else {"messages": [{"role": "user", "content": "hi"}]}
    with httpx.Client(timeout=60) as http, http.stream("POST", failing_gateway.url + path, json=body) as r:
        assert r.status_code == 200
        lines = [x for x in r.iter_lines() if x]
    assert lines[-1] == "data: [DONE]"
    events = [json.loads(x[6:]) for x in lines[:-1]]
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1, events
    err = errors[0]["error"]
    assert err["code"] == "unavailable" and "stopped before the request finished" in err["message"], err
    before = events[:events.index(errors[0])]
    assert [c["finish_reason"] for e in before for c in e["choices"] if c["finish_reason"]] == ["error"]
    assert events[-1]["usage"]["completion_tokens"] >= FAIL_AFTER
    wait_until(local.loop.is_idle_clean, 20, what="the failed request to be freed")
