"""A gateway shutting down with streams open (SIGTERM, Ctrl-C, a rolling update): an attack
session found uvicorn cancelling the still-running stream at the end of the grace period,
its client left with a cut-off body (no last chunk, no `data: [DONE]`) and the server log
with a traceback of the cancellation. Now each stream still open when the grace period ends
is aborted: its client gets a last chunk with finish_reason "abort", the usage it asked for
and `[DONE]`, and the request is freed on the replica."""
from __future__ import annotations

import json
import logging
import threading

import httpx
import pytest

from e2e_harness import MODEL, wait_until
from gateway_harness import Gateway

GRACE_S = 1.0


@pytest.fixture
def shutting_gateway(local_stack):
    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.cluster.gateway_server import GatewayServer

    app = create_app(local_stack.client, GatewaySettings(admin_token="t"))
    gw = Gateway(app, make_server=lambda a, **opts: GatewayServer(a, local_stack.client, GRACE_S, **opts))
    yield gw
    gw.close()


def test_streams_open_at_the_end_of_the_grace_period_end_with_abort_and_done(local, shutting_gateway, caplog):
    gw = shutting_gateway
    lines: list[str] = []
    started = threading.Event()

    def stream():
        body = {"model": MODEL, "prompt": "t567;e03627", "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        with httpx.Client(timeout=60) as http, http.stream("POST", f"{gw.url}/v1/completions", json=body) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    started.set()

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60), "the stream never started"
    with caplog.at_level(logging.ERROR):
        gw.server.should_exit = True  # what uvicorn's signal handler does on SIGTERM / Ctrl-C
        gw.thread.join(timeout=30)
        t.join(timeout=30)
    assert not gw.thread.is_alive() and not t.is_alive()
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(x[6:]) for x in lines[:-1]]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort"], finishes
    assert 0 < events[-1]["usage"]["completion_tokens"] < 1900
    assert gw.server.streams_ended == 1
    assert not [r for r in caplog.records if "ASGI" in r.getMessage() or "Cancel" in r.getMessage()], caplog.text
    wait_until(local.loop.is_idle_clean, 20, what="the aborted request to be freed")
