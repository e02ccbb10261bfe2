"""Accuracy under forced retraction, one live server per arm.

    python -m hyrax.tasks.arms --limit 200

For each arm this starts `hyrax serve --colocated` on a loopback port as a subprocess
(HYRAX_ADMIN_TOKEN set), waits for /health, runs the held-out split through the openai
client with `--concurrency` requests in flight, scrapes the retraction and restore counters
from /metrics, stops the server with SIGTERM and prints one markdown table row.

Every arm runs `--deterministic`, so the lossless arms must reproduce the no-retraction arm
answer for answer. The fault arm is the seeds' bug: every backup leaves the Mamba state
(`mamba_conv` and `mamba_ssm`) out and restore does not verify, so a restored request
continues on whatever recurrent state its new slot held — another request's, or zeros —
and loses its place in the answer. The same fault with verification on is caught at
restore (the manifest lacks components) and the request is rebuilt by recompute. The last
arm drops only `mamba_ssm`, to show how much of the damage that component alone does.
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass

FORCED = ["--forced-retraction-interval", "3"]
# The seeds' bug: the backup carries attention K/V only; the request's recurrent state (the
# Mamba pool: conv and SSM state) is left behind
FAULT = ["--unsafe-allow-fault-injection", "--unsafe-skip-backup-component", "mamba_conv,mamba_ssm"]
SSM_ONLY = ["--unsafe-allow-fault-injection", "--unsafe-skip-backup-component", "mamba_ssm"]


@dataclass(frozen=True)
class Arm:
    name: str
    flags: tuple[str, ...]


ARMS = (
    Arm("no retraction", ()),
    Arm("forced retraction every 3 steps, cpu_tensor", (*FORCED, "--retraction-backup", "cpu_tensor")),
    Arm("forced retraction every 3 steps, host_pool", (*FORCED, "--retraction-backup", "host_pool")),
    Arm("forced retraction every 3 steps, recompute", (*FORCED, "--retraction-backup", "recompute")),
    Arm("fault: backup drops the Mamba state, verification off", (*FORCED, *FAULT, "--unsafe-disable-verification")),
    Arm("fault: backup drops the Mamba state, verification on", (*FORCED, *FAULT)),
    Arm("fault: backup drops mamba_ssm only, verification off", (*FORCED, *SSM_ONLY, "--unsafe-disable-verification")),
)
COMMON = ("--colocated", "--deterministic", "--max-running", "8")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, ""


def wait_healthy(proc: subprocess.Popen, base: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"hyrax serve exited with code {proc.returncode} before becoming healthy")
        try:
            if _get(base + "/health")[0] == 200:
                return
        except OSError:
            pass
        time.sleep(1.0)
    raise RuntimeError(f"hyrax serve did not become healthy within {timeout:.0f}s")


def scrape_counters(base: str) -> dict[str, int]:
    """retractions (all triggers and modes), restores (verified + recompute) and fallbacks
    (fallback + checksum_mismatch) from /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    _, text = _get(base + "/metrics", timeout=30)
    out = {"retractions": 0, "restores": 0, "fallbacks": 0}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "hyrax_retractions_total":
                out["retractions"] += int(s.value)
            elif s.name == "hyrax_restores_total":
                key = "fallbacks" if s.labels.get("result") in ("fallback", "checksum_mismatch") else "restores"
                out[key] += int(s.value)
    return out


def stop(proc: subprocess.Popen, grace: float = 60.0) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_arm(arm: Arm, limit: int, concurrency: int, model: str, start_timeout: float, log) -> dict:
    from hyrax.tasks import recall
    from hyrax.tasks.evaluate import run_server

    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "hyrax.cluster.cli", "serve", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), *COMMON, *arm.flags]
    env = dict(os.environ, HYRAX_ADMIN_TOKEN=secrets.token_urlsafe(24), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0")
    log(f"arm {arm.name!r}: {' '.join(cmd[2:])}")
    with tempfile.TemporaryFile("w+") as server_log:
        proc = subprocess.Popen(cmd, env=env, stdout=server_log, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)
        try:
            wait_healthy(proc, base, start_timeout)
            problems = recall.heldout(limit)
            t0 = time.perf_counter()
            completions, errors = run_server(base, problems, concurrency)
            result = recall.score(problems, completions)
            result.update(scrape_counters(base), errors=errors, seconds=round(time.perf_counter() - t0, 1))
        except BaseException:
            stop(proc, 10)
            server_log.seek(0)
            log(server_log.read()[-3000:])
            raise
        stop(proc)
    log(f"  -> {json.dumps(result)}")
    return {"arm": arm.name, "flags": " ".join(arm.flags), **result, "completions": completions}


def table(rows: list[dict]) -> str:
    """Markdown table; 'same text' counts completions identical to the first arm's."""
    lines = ["| arm | accuracy | invalid rate | retractions | restores | fallbacks | same text as first arm |",
             "|---|---:|---:|---:|---:|---:|---:|"]
    first = rows[0]["completions"] if rows else []
    for r in rows:
        same = sum(a == b for a, b in zip(r["completions"], first))
        lines.append(f"| {r['arm']} | {r['accuracy']:.3f} | {r['invalid_rate']:.3f} | {r['retractions']} "
                     f"| {r['restores']} | {r['fallbacks']} | {same}/{r['n']} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m hyrax.tasks.arms", description=__doc__.split("\n\n")[0])
    ap.add_argument("--limit", type=int, default=200, help="held-out problems per arm (default 200)")
    ap.add_argument("--concurrency", type=int, default=8, help="requests in flight (default 8)")
    ap.add_argument("--model", default="demo")
    ap.add_argument("--arms", default=None, help="comma-separated arm numbers to run (1-based; default all)")
    ap.add_argument("--start-timeout", type=float, default=300.0, help="seconds to wait for /health")
    ap.add_argument("--json", action="store_true", help="also print the rows as JSON")
    a = ap.parse_args(argv)
    picked = ARMS if not a.arms else [ARMS[int(i) - 1] for i in a.arms.split(",")]
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    rows = [run_arm(arm, a.limit, a.concurrency, a.model, a.start_timeout, log) for arm in picked]
    print(f"`python -m hyrax.tasks.arms --limit {a.limit} --concurrency {a.concurrency}` "
          f"(every server: `hyrax serve {' '.join(COMMON)} ...`)\n")
    print(table(rows))
    if a.json:
        print(json.dumps([{k: v for k, v in r.items() if k != "completions"} for r in rows], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
