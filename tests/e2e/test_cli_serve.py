"""The real `hyrax serve` command in a subprocess (its own local Ray cluster): it serves
completions and the admin API, keeps everything on 127.0.0.1 — the gateway, Ray's own
daemons and workers, and the TP ranks' collective group — even when the environment does not
set RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER (Ray reads it once, when it is first imported), sizes
its local cluster to the deployment (one logical CPU per TP rank, with a note when that
exceeds the machine's cores), and stops cleanly on SIGTERM.

One server run (prefill TP=2 + decode TP=1: three ranks and one collective group) is shared by
the tests below; the fixture records what happened at each stage and the tests judge it, so
one failure does not hide the others.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from hyrax.actors import cpu_claims

from e2e_harness import MODEL, free_port, group_alive, port_is_free, sse_data, wait_until
from listen_harness import listening, session_pids
from serve_harness import wait_serving

pytestmark = pytest.mark.timeout(300)
HYRAX = Path(sys.executable).with_name("hyrax")
TOKEN = "cli-e2e-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
STREAM_TOKENS = 400  # ~2 s of decoding: time for the admin calls to find it running on a loaded machine
GRACE_S = 1


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = tmp_path_factory.mktemp("cli") / "serve.log"
    # a cluster of its own, without the variable that keeps Ray on 127.0.0.1
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")}
    env["HYRAX_ADMIN_TOKEN"] = TOKEN
    out: dict = {"url": url, "port": port}
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([str(HYRAX), "serve", "--port", str(port), "--prefill-tp", "2",
                                 "--grace-period", str(GRACE_S)], env=env,
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    out["pgid"] = proc.pid
    try:
        wait_serving(proc, url, log_path, 180)
        out["banner"] = log_path.read_text()

        r = httpx.post(f"{url}/v1/completions", timeout=60, json={
            "model": MODEL, "prompt": "Hello from the CLI test", "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})
        out["completion"] = (r.status_code, r.json())  # through the TP=2 prefill's group
        out["listening"] = listening(session_pids(proc.pid))
        out["commands"] = {pid: Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:80]
                           for pid, _, _ in out["listening"]}
        out["claimed"] = cpu_claims.claimed()  # by its ranks (or ranks of earlier tests still alive)
        out["gateway_cpus"] = _thread_cpus(proc.pid)

        # a long stream, retracted by the admin API while it runs
        stream: dict = {}

        def read_stream():
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": "A long one", "max_tokens": STREAM_TOKENS, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
                stream["status"] = r.status_code
                stream["events"] = sse_data(r.iter_lines())

        reader = threading.Thread(target=read_stream, daemon=True)
        reader.start()

        def running():
            reqs = httpx.get(f"{url}/admin/requests", headers=ADMIN, timeout=10).json()["requests"]
            # on the decode replica: on the prefill one a running request may be in its hand-off
            # at the instant the retraction arrives, and then neither replica has it to retract
            return [q for q in reqs if q["state"] == "running" and q["role"] == "decode" and q["output_tokens"] > 1]

        wait_until(running, 60, interval=0.05, what="the long stream to run")
        out["wrong_token"] = httpx.post(f"{url}/admin/retract", headers={"Authorization": "Bearer nope"},
                                        json={"all": True}, timeout=30).status_code
        r = httpx.post(f"{url}/admin/retract", headers=ADMIN, json={"all": True, "mode": "cpu_tensor"}, timeout=30)
        out["retract"] = (r.status_code, r.json())
        reader.join(timeout=120)
        out["stream"] = stream
        time.sleep(0.5)
        out["requests_after"] = httpx.get(f"{url}/admin/requests", headers=ADMIN, timeout=10).json()["requests"]

        # a stream still running at SIGTERM: aborted after the grace period, and it says so
        last: dict = {}

        def read_last():
            with httpx.stream("POST", f"{url}/v1/completions", timeout=120, json={
                    "model": MODEL, "prompt": "Until the end", "max_tokens": 1900, "temperature": 0,
                    "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}) as r:
                try:
                    last["events"] = sse_data(r.iter_lines())
                except httpx.HTTPError as e:  # a body cut short
                    last["error"] = repr(e)
        last_reader = threading.Thread(target=read_last, daemon=True)
        last_reader.start()
        wait_until(running, 60, interval=0.05, what="the last stream to run")
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        try:
            out["returncode"] = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            out["returncode"] = None
        out["stop_seconds"] = time.monotonic() - t0
        last_reader.join(timeout=30)
        out["last_stream"] = last
        out["log"] = log_path.read_text()
        yield out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        if group_alive(proc.pid):  # Ray processes the server left behind
            os.killpg(proc.pid, signal.SIGKILL)


def test_cli_serves_completions_and_admin_then_stops_on_sigterm(served):
    url = served["url"]
    assert f"{url}/v1" in served["banner"] and "admin token" in served["banner"]
    assert "from HYRAX_ADMIN_TOKEN" in served["banner"]
    assert TOKEN not in served["banner"]  # the token itself is never printed

    status, body = served["completion"]
    assert status == 200, body
    assert body["model"] == MODEL and body["choices"][0]["finish_reason"] == "length"
    assert body["usage"]["completion_tokens"] == 8

    assert served["wrong_token"] == 401
    status, body = served["retract"]
    assert status == 200, body
    assert len(body["retracted"]) == 1, body  # the running stream was retracted ...
    events = served["stream"]["events"]
    assert served["stream"]["status"] == 200 and events[-1] == "[DONE]"
    assert events[-2]["usage"]["completion_tokens"] == STREAM_TOKENS  # ... and still completed
    assert events[-3]["choices"][0]["finish_reason"] == "length"
    assert served["requests_after"] == []

    assert served["returncode"] is not None, f"still running 60 s after SIGTERM:\n{served['log'][-3000:]}"
    assert served["stop_seconds"] < 60
    assert "Traceback" not in served["log"], served["log"][-3000:]
    # the stream open at SIGTERM ended the ordinary way once the grace period was over
    last = served["last_stream"]
    assert "error" not in last and last["events"][-1] == "[DONE]", last
    assert last["events"][-3]["choices"][0]["finish_reason"] == "abort", last["events"][-3:]
    assert 0 < last["events"][-2]["usage"]["completion_tokens"] < 1900
    assert port_is_free(served["port"])
    wait_until(lambda: not group_alive(served["pgid"]), 30, interval=0.5,
               what="the server's Ray processes to exit")


def _thread_cpus(pid: int) -> set[frozenset[int]]:
    """The CPU sets the threads of process `pid` may run on."""
    out = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            out.add(frozenset(os.sched_getaffinity(int(tid))))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


def test_the_gateway_keeps_off_the_cpus_the_ranks_claimed(served):
    """The ranks' CPUs are theirs: every thread of the gateway's process runs elsewhere
    (cpu_claims.py). A machine with one CPU has none to claim."""
    if len(os.sched_getaffinity(0)) < 2 or cpu_claims.cpu_quota():
        pytest.skip("one CPU, or CPU time capped by a cgroup quota: no rank claims one")
    assert served["claimed"], "no rank claimed a CPU"
    assert all(not (cpus & served["claimed"]) and cpus for cpus in served["gateway_cpus"]), served


def test_cli_exits_with_code_0_on_sigterm(served):
    assert served["returncode"] == 0


def test_local_serve_listens_on_loopback_only_ray_and_collective_group_included(served):
    socks = served["listening"]
    rank_socks = [s for s in socks if "RankWorker" in served["commands"][s[0]]]
    assert len({pid for pid, _, _ in rank_socks}) == 3, socks  # every rank was seen
    wrong = [(s, served["commands"][s[0]]) for s in socks if s[1] != "127.0.0.1"]
    assert not wrong, f"listening beyond 127.0.0.1: {wrong}"


def test_the_banner_names_the_ray_clusters_address_to_attach_to(served):
    """`hyrax serve --address ADDR --attach` needs the local cluster's address, on a port Ray
    picks: the banner prints it (a loopback address one of the server's processes listens on)."""
    m = re.search(r"Ray cluster\s+([0-9.]+):(\d+) ", served["banner"])
    assert m is not None, served["banner"][-2000:]
    assert m.group(1) == "127.0.0.1"
    assert int(m.group(2)) in {port for _, _, port in served["listening"]}, served["listening"]


def test_local_cluster_gets_one_logical_cpu_per_rank(served):
    cores = len(os.sched_getaffinity(0))
    note = "note: the local Ray cluster gets 3 logical CPUs (one per TP rank)"
    assert (note in served["banner"]) == (cores < 3), served["banner"][-2000:]
