"""`hyrax serve` stopped by a SIGTERM to its whole process group (GNU `timeout`, systemd's
default KillMode=control-group): Ray's GCS and raylet get the signal too and are gone before
the server's own shutdown runs. The server notices the cluster is gone and exits at once with
code 0, leaving no process behind; it used to wait a minute for the dead GCS in its tear-down
(Ray's "Failed to connect to GCS within 60 seconds")."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from e2e_harness import free_port, group_alive
from serve_harness import wait_serving

pytestmark = pytest.mark.timeout(240)
HYRAX = Path(sys.executable).with_name("hyrax")


def test_a_sigterm_to_the_whole_group_stops_the_server_within_seconds(tmp_path):
    port = free_port()
    log_path = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(HYRAX), "serve", "--port", str(port)], env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_serving(proc, f"http://127.0.0.1:{port}", log_path, 180)
        t0 = time.monotonic()
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            code = None
        took = time.monotonic() - t0
        deadline = time.monotonic() + 20
        while group_alive(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        log = log_path.read_text()
        assert code == 0, f"exit code {code} after {took:.1f} s:\n{log[-3000:]}"
        assert "the Ray cluster already stopped" in log, log[-3000:]
        assert not group_alive(proc.pid), "processes of the server's group are still running"
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if group_alive(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
