"""A client that drops a streaming connection mid-way: its requests are aborted and every
pool of the in-process engine is clean again within seconds."""
from __future__ import annotations

import pytest

from e2e_harness import DISCONNECT_MAX_TOKENS, disconnect_mid_stream, finished_count, wait_until


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
