"""Multi-node Ray on one machine, for the tests (tests/multinode) and `hyrax bench --suite
multinode`: a cluster of several raylets held by a child process (cluster_holder.py), and
`hyrax serve` gateways joined to it, each in a process group of its own.

The calling process never joins that cluster (the integration suite's session cluster may
already be initialised in it): it talks to the gateways over HTTP and to the holder over pipes."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

HYRAX = Path(sys.executable).with_name("hyrax")
MARK = "@hyrax-holder "  # cluster_holder.MARK: its answers' prefix
TOKEN = "multinode-admin-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
MODEL = "hyrax-demo"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred, timeout: float, interval: float = 0.05, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        v = pred()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    e["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the held cluster lives on 127.0.0.1
    e["HYRAX_ADMIN_TOKEN"] = TOKEN
    return e


class HeldCluster:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-m", "hyrax.testing.cluster_holder"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env(), start_new_session=True)
        self.address = self._answer()["address"]

    def _answer(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            assert line, "the cluster holder exited"
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def add_node(self, name: str, num_cpus: int, resources: dict | None = None) -> str:
        return self._ask(op="add", name=name, num_cpus=num_cpus, resources=resources or {})["node_id"]

    def remove_node(self, name: str) -> None:
        self._ask(op="remove", name=name)

    def placement(self) -> dict[str, list[str]]:
        """Placement group name -> the node (by the name given to add_node) of each bundle."""
        return self._ask(op="placement")["groups"]

    def clean(self, actors: list[str], namespace: str = "hyrax") -> dict:
        return self._ask(op="clean", actors=actors, namespace=namespace)["clean"]

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # the holder shuts its cluster down on EOF
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class Gateway:
    """One `hyrax serve` process joined to the held cluster."""

    def __init__(self, address: str, log_dir: Path, name: str, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen([str(HYRAX), "serve", "--address", address, "--port", str(self.port), *args],
                                         env=env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_serving(self, timeout: float = 180) -> "Gateway":
        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"hyrax serve exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                return httpx.get(f"{self.url}/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, timeout, interval=0.5, what=f"{self.url}/health")
        return self

    def kill(self) -> None:
        """SIGKILL: no shutdown path runs (a pod evicted, a node lost)."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def admin(self, path: str):
        r = httpx.get(f"{self.url}/admin/{path}", headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def complete(self, prompt: str, max_tokens: int, **kw) -> str:
        r = httpx.post(f"{self.url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def finished_by_reason(self) -> dict[str, float]:
        """hyrax_requests_finished_total summed over replicas, by finish_reason."""
        out: dict[str, float] = {}
        for line in httpx.get(f"{self.url}/metrics", timeout=30).text.splitlines():
            if line.startswith("hyrax_requests_finished_total{"):
                labels, value = line.rsplit(" ", 1)
                reason = labels.split('finish_reason="', 1)[1].split('"', 1)[0]
                out[reason] = out.get(reason, 0) + float(value)
        return out


class Stream:
    """One streaming completion read in a thread: its text, chunk count, and how it ended."""

    def __init__(self, gw: Gateway, prompt: str, max_tokens: int, request_id: str):
        self.text, self.chunks, self.error, self.done = "", 0, None, False
        self.chunk_times: list[float] = []  # time.monotonic() of each chunk
        self.request_id = request_id
        body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                "stream": True}
        self._thread = threading.Thread(target=self._read, args=(gw.url, body), daemon=True)
        self._thread.start()

    def _read(self, url: str, body: dict) -> None:
        try:
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(120, read=120),
                              headers={"X-Request-Id": self.request_id}) as r:
                for line in r.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        self.done = True
                        break
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        self.error = chunk["error"]
                        break
                    self.chunks += 1
                    self.chunk_times.append(time.monotonic())
                    self.text += chunk["choices"][0]["text"]
        except Exception as e:  # noqa: BLE001 - a broken connection is this stream's outcome
            self.error = f"{type(e).__name__}: {e}"

    def join(self, timeout: float = 120) -> "Stream":
        self._thread.join(timeout)
        assert not self._thread.is_alive(), f"stream {self.request_id} still open after {timeout:g} s"
        return self
