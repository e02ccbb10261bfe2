"""A local `hyrax serve` keeps everything on 127.0.0.1: the gateway, Ray's own daemons and
workers, and the TP ranks' collective group — even when the environment does not set
RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (Ray reads it once, when it is first imported). Its local
cluster is sized to the deployment (one logical CPU per TP rank), with a note when that
exceeds the machine's cores.

One server (prefill TP=2 + decode TP=1, so three ranks and one collective group) is started
for the module; the fixture records what it saw and the tests judge it.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from e2e_harness import MODEL, free_port
from listen_harness import listening, session_pids
from serve_harness import wait_serving

pytestmark = pytest.mark.timeout(300)
HYRAX = Path(sys.executable).with_name("hyrax")


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("local_net") / "serve.log"
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["HYRAX_ADMIN_TOKEN"] = "local-net-token"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(HYRAX), "serve", "--port", str(port), "--prefill-tp", "2"], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out: dict = {}
    try:
        wait_serving(proc, url, log_path, 180)
        r = httpx.post(f"{url}/v1/completions", timeout=60, json={  # through the TP=2 prefill's group
            "model": MODEL, "prompt": "Hello over the group", "max_tokens": 4, "temperature": 0, "ignore_eos": True})
        out["completion"] = (r.status_code, r.json())
        out["listening"] = listening(session_pids(proc.pid))
        out["commands"] = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
                           for pid, _, _ in out["listening"]}
        out["banner"] = log_path.read_text()
        proc.send_signal(signal.SIGTERM)
        out["returncode"] = proc.wait(timeout=60)
        yield out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # Ray processes the server left behind
        except ProcessLookupError:
            pass


def test_local_serve_listens_on_loopback_only_ray_and_collective_group_included(served):
    status, body = served["completion"]
    assert status == 200, body
    socks = served["listening"]
    rank_socks = [s for s in socks if "RankWorker" in served["commands"][s[0]]]
    assert len({pid for pid, _, _ in rank_socks}) == 3, socks  # every rank was seen
    wrong = [(s, served["commands"][s[0]]) for s in socks if s[1] != "127.0.0.1"]
    assert not wrong, f"listening beyond 127.0.0.1: {wrong}"
    assert served["returncode"] == 0


def test_local_cluster_gets_one_logical_cpu_per_rank(served):
    cores = len(os.sched_getaffinity(0))
    note = "note: the local Ray cluster gets 3 logical CPUs (one per TP rank)"
    assert (note in served["banner"]) == (cores < 3), served["banner"][-2000:]
