"""A gateway shutting down with streams open (SIGTERM, Ctrl-C, a rolling update): an attack
session found uvicorn cancelling the still-running stream at the end of the grace period,
its client left with a cut-off body (no last chunk, no `data: [DONE]`) and the server log
with a traceback of the cancellation. Now each stream still open when the grace period ends
is aborted: its client gets a last chunk with finish_reason "abort", the usage it asked for
and `[DONE]`, and the request is freed on the replica."""
from __future__ import annotations

import json
import logging
import signal
import threading
import time

import httpx
import pytest

from e2e_harness import MODEL, wait_until
from gateway_harness import Gateway

GRACE_S = 1.0


def _gateway(client, grace_s: float):
    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.cluster.gateway_server import GatewayServer

    app = create_app(client, GatewaySettings(admin_token="t"))
    return Gateway(app, make_server=lambda a, **opts: GatewayServer(a, client, grace_s, **opts))


@pytest.fixture
def shutting_gateway(local_stack):
    gw = _gateway(local_stack.client, GRACE_S)
    yield gw
    gw.close()


@pytest.fixture
def patient_gateway(local_stack):
    """A gateway whose streams get a minute to finish on shutdown."""
    gw = _gateway(local_stack.client, 60.0)
    yield gw
    gw.close()


def _open_stream(gw) -> tuple[threading.Thread, list[str]]:
    """A long streaming completion in a thread, started (its first line read); its lines."""
    lines: list[str] = []
    started = threading.Event()

    def stream():
        body = {"model": MODEL, "prompt": "t567;e03627", "max_tokens": 1900, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        try:
            with httpx.Client(timeout=60) as http, http.stream("POST", f"{gw.url}/v1/completions", json=body) as r:
                for line in r.iter_lines():
                    if line:
                        lines.append(line)
                        started.set()
        except httpx.HTTPError as e:  # a body cut off: what the assertions on `lines` must catch
            lines.append(f"cut off: {e!r}")

    t = threading.Thread(target=stream)
    t.start()
    assert started.wait(60), "the stream never started"
    return t, lines


def _ended_with_abort_and_done(lines: list[str], caplog) -> None:
    assert lines[-1] == "data: [DONE]", lines[-3:]
    events = [json.loads(x[6:]) for x in lines[:-1]]
    finishes = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finishes == ["abort"], finishes
    assert 0 < events[-1]["usage"]["completion_tokens"] < 1900
    assert not [r for r in caplog.records if "ASGI" in r.getMessage() or "Cancel" in r.getMessage()], caplog.text


def test_streams_open_at_the_end_of_the_grace_period_end_with_abort_and_done(local, shutting_gateway, caplog):
    gw = shutting_gateway
    t, lines = _open_stream(gw)
    with caplog.at_level(logging.ERROR):
        gw.server.should_exit = True  # what uvicorn's signal handler does on SIGTERM / Ctrl-C
        gw.thread.join(timeout=30)
        t.join(timeout=30)
    assert not gw.thread.is_alive() and not t.is_alive()
    _ended_with_abort_and_done(lines, caplog)
    assert gw.server.streams_ended == 1
    wait_until(local.loop.is_idle_clean, 20, what="the aborted request to be freed")


def test_a_second_ctrl_c_ends_open_streams_at_once_with_abort_and_done(local, patient_gateway, caplog):
    """Ctrl-C twice (uvicorn's 'force quit'): the streams end now, not after the grace period,
    and still the ordinary way; before, uvicorn stopped waiting and cut every open stream off
    (no last chunk, no [DONE], a traceback per stream in the log)."""
    gw = patient_gateway
    t, lines = _open_stream(gw)
    with caplog.at_level(logging.ERROR):
        began = time.monotonic()
        gw.server.handle_exit(signal.SIGINT, None)  # what the signal handler is called with
        time.sleep(0.3)
        gw.server.handle_exit(signal.SIGINT, None)
        gw.thread.join(timeout=30)
        t.join(timeout=30)
        took = time.monotonic() - began
    assert not gw.thread.is_alive() and not t.is_alive()
    assert took < 10, f"the second Ctrl-C still waited {took:.1f} s"
    _ended_with_abort_and_done(lines, caplog)
    assert gw.server.streams_ended == 1
    wait_until(local.loop.is_idle_clean, 20, what="the aborted request to be freed")
