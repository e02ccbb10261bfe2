"""A client that drops a streaming connection mid-way: its requests are aborted and every
pool of the in-process engine is clean again within seconds."""
from __future__ import annotations

import httpx
import pytest

from e2e_harness import (
    DISCONNECT_MAX_TOKENS, E2E_CONFIG, MODEL, disconnect_mid_stream, finished_count, local_gateway, wait_until,
)
from hyrax.actors.engine.config import UnsafeFaults


@pytest.mark.parametrize("path,n", [("/v1/completions", 1), ("/v1/chat/completions", 2)])
def test_disconnect_mid_stream_aborts_the_request_and_frees_every_pool(local, path, n):
    aborted = finished_count(local.loop.stats(), "abort")
    since = len(local.client.requests)

    disconnect_mid_stream(local.url, path, n)

    wait_until(local.loop.is_idle_clean, 20, what="the engine to drop the abandoned request")
    assert local.loop.check_invariants()
    assert finished_count(local.loop.stats(), "abort") == aborted + n
    recs = list(local.client.requests.values())[since:]
    assert len(recs) == n
    assert all(r["finish_reason"] is None and len(r["tokens"]) < DISCONNECT_MAX_TOKENS for r in recs)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_a_client_that_leaves_before_its_stream_began_aborts_it_and_frees_every_pool(path):
    """A stream's response begins only once a choice is under way (its first token: docs/api.md,
    Errors); a client that gives up before that, on a slow device, is gone before any header.
    Its request is aborted and every pool is clean again, as for one that leaves mid-stream."""
    import dataclasses

    config = dataclasses.replace(E2E_CONFIG, faults=UnsafeFaults(step_delay_ms=1500.0), allow_unsafe=True)
    body = {"model": MODEL, "max_tokens": 8, "stream": True}
    body.update({"prompt": "Tell me"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    with local_gateway(config) as stack:
        with pytest.raises(httpx.ReadTimeout):  # no headers within 0.3 s: the first step takes 1.5 s
            httpx.post(f"{stack.url}{path}", json=body, timeout=httpx.Timeout(5.0, read=0.3))
        wait_until(lambda: finished_count(stack.loop.stats(), "abort") == 1, 20, what="the request to be aborted")
        wait_until(stack.loop.is_idle_clean, 20, what="the engine to drop the abandoned request")
        assert stack.loop.check_invariants()
        # it left before its first token, and the gateway heard it then: not when that token came
        assert [(r["tokens"], r["finish_reason"]) for r in stack.client.requests.values()] == [([], None)]
