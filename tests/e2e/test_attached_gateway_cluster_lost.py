"""A gateway attached to the cluster of another `hyrax serve` (`hyrax serve --address ADDR
--attach`, the command the first one's banner prints), when that first server is killed with
SIGKILL: Ray starts a local cluster's GCS and raylet bound to the process that started it, so
they die with it, and so do the replicas.

The attached gateway used to answer every request 503 for a minute and then die of Ray's own
"Failed to connect to GCS within 60 seconds", a fatal Ray error on the terminal.
It now notices within seconds (hyrax/cluster/cluster_watch.py): its open stream ends with an
error event and [DONE], what it answers meanwhile is an OpenAI-shaped 503 with Retry-After,
and it exits by itself with one line that says why and a nonzero status."""
from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest

from e2e_harness import assert_error, group_alive, sse_data
from hyrax.testing.multinode import HTTP, MODEL, Gateway, wait_until

pytestmark = pytest.mark.timeout(240)
STOPS_WITHIN_S = 15.0  # Ray itself gives up on the GCS after 60 s


def _stream(url: str, out: list[str]) -> None:
    """A long completion streamed from `url`, its lines appended to `out` as they come."""
    try:
        with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                "model": MODEL, "prompt": "hello", "max_tokens": 1500, "temperature": 0, "ignore_eos": True,
                "stream": True}) as r:
            out.append(f"status {r.status_code}")
            out.extend(line for line in r.iter_lines() if line)
    except httpx.HTTPError as e:
        out.append(f"cut off: {type(e).__name__}")


def test_an_attached_gateway_stops_by_itself_when_the_server_that_started_its_cluster_is_killed(
        tmp_path, monkeypatch):
    owner = Gateway(None, tmp_path, "owner", "--colocated")  # one replica: the quicker start
    attached = None
    try:
        owner.wait_serving()
        command = re.search(r"another gateway: (.+)\)$", owner.log.read_text(), re.M).group(1)
        words = command.split()
        for word in words:  # RAY_AUTH_MODE=token: the attached server sends the cluster's token
            if "=" in word:
                monkeypatch.setenv(*word.split("=", 1))
        attached = Gateway(words[words.index("--address") + 1], tmp_path, "attached", "--attach").wait_serving()

        lines: list[str] = []
        reader = threading.Thread(target=_stream, args=(attached.url, lines), daemon=True)
        reader.start()
        wait_until(lambda: len(lines) >= 2, 60, what="the stream's first token")
        said_before = len(attached.log.read_text())

        os.kill(owner.proc.pid, signal.SIGKILL)  # the server alone, as `kill -9 PID` does
        killed = time.monotonic()
        answers = []
        while attached.proc.poll() is None and time.monotonic() - killed < 2 * STOPS_WITHIN_S:
            try:
                answers.append(HTTP.post(f"{attached.url}/v1/completions", timeout=30,
                                         json={"model": MODEL, "prompt": "hi", "max_tokens": 2}))
            except httpx.TransportError:
                pass  # the gateway closed its socket: it is stopping
            time.sleep(0.2)
        code = attached.proc.poll()
        took = time.monotonic() - killed
        said = attached.log.read_text()[said_before:]
        assert code is not None and took < STOPS_WITHIN_S, f"still running {took:.1f} s after the kill:\n{said[-3000:]}"
        assert code != 0, said[-3000:]

        for r in answers:  # before the loss shows, a replica may still answer; never a 500, never a hang
            if r.status_code != 200:
                assert_error(r, 503)
                assert r.headers.get("Retry-After"), r.headers
        reader.join(30)
        events = sse_data(lines)
        assert lines[0] == "status 200" and events[-1] == "[DONE]", lines[-3:]
        assert "error" in events[-2], lines[-3:]

        assert "Traceback" not in said and "Failed to connect to GCS" not in said, said[-3000:]
        ours = [line for line in said.splitlines() if line.startswith("hyrax:")]
        assert len(ours) == 1 and "stopped answering" in ours[0] and "this gateway stops" in ours[0], said[-3000:]
        wait_until(lambda: not group_alive(attached.proc.pid), 20, interval=0.2,
                   what="every process of the attached gateway's group to end")
    finally:
        for g in (attached, owner):
            if g is not None:
                g.kill()
                if group_alive(g.proc.pid):  # what Ray left of the killed server's cluster
                    os.killpg(g.proc.pid, signal.SIGKILL)
