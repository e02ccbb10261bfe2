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
# one client for every call (httpx.get/post build a client, and with it an SSL context, per call:
# ~75 ms each on a 2-core machine, paid by every poll); no keep-alive: each call still opens and
# closes its own connection, as a fresh client did, and concurrent streams are not capped
HTTP = httpx.Client(limits=httpx.Limits(max_connections=None, max_keepalive_connections=0))
DEMO = str(Path(__file__).resolve().parents[1] / "models" / "demo")


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


def wait_serving(proc: subprocess.Popen, url: str, log_path: Path, timeout: float) -> None:
    """Until `url`/health answers 200 (the `hyrax serve` in `proc` is up); a server that exits
    first fails with its log's tail."""
    def up():
        if proc.poll() is not None:
            raise AssertionError(f"hyrax serve exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            return HTTP.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_until(up, timeout, interval=0.5, what=f"{url}/health")


def env() -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    e["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # the held cluster lives on 127.0.0.1
    e["HYRAX_ADMIN_TOKEN"] = TOKEN
    return e


def reference_texts(prompts: list[str], max_tokens: int) -> dict[str, str]:
    """Every prompt's greedy text (ignoring EOS) from the single-process engine on the demo model,
    deterministic: what every deployment must give, however its requests moved."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.local import load_engine, run_to_completion
    from hyrax.actors.engine.request import SamplingParams
    from hyrax.actors.model.config import ModelConfig
    from hyrax.actors.model.tokenizer import load_tokenizer

    tok = load_tokenizer(DEMO, ModelConfig.from_dir(DEMO).vocab_size)
    engine = load_engine(DEMO, EngineConfig(deterministic=True), decode=tok.decode)
    ids = {p: engine.add_request(tok.encode(p), SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
           for p in prompts}
    run_to_completion(engine)
    return {p: engine.finished_requests[rid].text for p, rid in ids.items()}


class _Piped:
    """A child process that answers JSON commands, one a line on its stdin; each answer is one
    JSON line after MARK on its stdout (anything else it prints is skipped)."""

    def __init__(self, *argv: str):
        self.proc = subprocess.Popen([sys.executable, "-m", *argv], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True, env=env(), start_new_session=True)

    def _answer(self) -> dict:
        while True:
            line = self.proc.stdout.readline()
            assert line, f"{self.proc.args[2]} exited"
            if line.startswith(MARK):
                return json.loads(line[len(MARK):])

    def _ask(self, **cmd) -> dict:
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def _ask_ok(self, **cmd) -> dict:
        """An answer that must not be an error."""
        out = self._ask(**cmd)
        assert "error" not in out, (cmd, out["error"])
        return out

    def shutdown(self) -> None:
        if self.proc.poll() is None:
            try:
                self.proc.stdin.close()  # it ends (and the holder shuts its cluster down) on EOF
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


class HeldCluster(_Piped):
    def __init__(self):
        super().__init__("hyrax.testing.cluster_holder")
        self.address = self._answer()["address"]

    def add_node(self, name: str, num_cpus: int, resources: dict | None = None) -> str:
        return self._ask(op="add", name=name, num_cpus=num_cpus, resources=resources or {})["node_id"]

    def remove_node(self, name: str) -> None:
        self._ask(op="remove", name=name)

    def placement(self) -> dict[str, list[str]]:
        """Placement group name -> the node (by the name given to add_node) of each bundle."""
        return self._ask(op="placement")["groups"]

    def clean(self, actors: list[str], namespace: str = "hyrax") -> dict:
        return self._ask(op="clean", actors=actors, namespace=namespace)["clean"]


class Driver(_Piped):
    """A Ray driver joined to the held cluster (`python -m hyrax.testing.multinode ADDRESS`), for
    what only a process in the cluster can do to its actors: list them, kill one (so that Ray
    restarts it, or SIGKILL its process), freeze one (a hang). The actors must run on this
    machine (they do on the held cluster)."""

    def __init__(self, address: str):
        super().__init__("hyrax.testing.multinode", address)
        self._answer()  # joined

    def actors(self, namespace: str = "hyrax") -> dict[str, str]:
        """Every live named actor of `namespace`: name -> actor id."""
        return self._ask_ok(op="actors", namespace=namespace)["actors"]

    def kill(self, name: str, namespace: str = "hyrax", how: str = "ray") -> int:
        """`how`: "ray" (ray.kill without no_restart: Ray may restart it) or "sigkill" (its
        process, as a crash would). Returns the pid it had."""
        return self._ask_ok(op="kill", name=name, namespace=namespace, how=how)["pid"]

    def pid(self, name: str, namespace: str = "hyrax") -> int | None:
        """The pid of the actor's process; None while it has none (dead, or being restarted)."""
        return self._ask(op="pid", name=name, namespace=namespace).get("pid")

    def events(self, namespace: str = "hyrax") -> list[str]:
        """What the deployment's controller did (replicas lost, replaced, added, retired)."""
        return self._ask_ok(op="events", name="controller", namespace=namespace)["events"]

    def hang(self, name: str, namespace: str = "hyrax") -> int:
        """Freeze the actor's process (hyrax.testing.faults.hang_actor); returns its pid."""
        return self._ask_ok(op="hang", name=name, namespace=namespace)["pid"]


def _drive(address: str) -> None:
    """The Driver's process: join the cluster at `address`, then answer commands until stdin closes
    (a command that fails is answered with its error)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Ray's own messages go to stderr: nothing can split an answer
    sys.stdout = sys.stderr
    import ray

    def answer(obj) -> None:
        answers.write(MARK + json.dumps(obj) + "\n")
        answers.flush()

    ray.init(address=address, log_to_driver=False)
    answer({"ok": True})
    for line in sys.stdin:
        try:
            answer(_do(json.loads(line)))
        except Exception as e:  # noqa: BLE001 - the test reads it as the answer
            answer({"error": f"{type(e).__name__}: {e}"})
    ray.shutdown()


def _do(cmd: dict) -> dict:
    import ray

    from hyrax.testing.faults import actor_pid, hang_actor

    if cmd["op"] == "actors":
        return {"actors": {a["name"]: ray.get_actor(a["name"], namespace=a["namespace"])._actor_id.hex()
                           for a in ray.util.list_named_actors(all_namespaces=True)
                           if a["namespace"] == cmd["namespace"]}}
    actor = ray.get_actor(cmd["name"], namespace=cmd["namespace"])
    if cmd["op"] == "events":
        return {"events": ray.get(actor.events.remote(), timeout=60)}
    if cmd["op"] == "hang":
        return {"pid": hang_actor(actor, allow_unsafe=True)}
    pid = actor_pid(actor)
    if cmd["op"] == "kill" and cmd["how"] == "sigkill":
        os.kill(pid, signal.SIGKILL)
    elif cmd["op"] == "kill":
        ray.kill(actor, no_restart=False)
    return {"pid": pid}


class Gateway:
    """One `hyrax serve` process joined to the held cluster at `address`, or with `address` None
    on a local Ray cluster of its own (the gateway and the controller together)."""

    def __init__(self, address: str | None, log_dir: Path, name: str, *args: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log_dir / f"{name}.log"
        joined = ["--address", address] if address else []
        with open(self.log, "wb") as f:
            self.proc = subprocess.Popen([str(HYRAX), "serve", *joined, "--port", str(self.port), *args],
                                         env=env(), stdout=f, stderr=subprocess.STDOUT, start_new_session=True)

    def wait_serving(self, timeout: float = 180) -> "Gateway":
        wait_serving(self.proc, self.url, self.log, timeout)
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
                self.proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                self.kill()

    def admin(self, path: str):
        r = HTTP.get(f"{self.url}/admin/{path}", headers=ADMIN, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    def replicas(self) -> list[str]:
        """The replicas this gateway serves ("role/index"), sorted."""
        return sorted(f"{p['role']}/{p['replica']}" for p in self.admin("pools")["replicas"])

    def complete(self, prompt: str, max_tokens: int, **kw) -> str:
        r = HTTP.post(f"{self.url}/v1/completions", timeout=300, json={
            "model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True, **kw})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]

    def finished_by_reason(self) -> dict[str, float]:
        """hyrax_requests_finished_total summed over replicas, by finish_reason."""
        out: dict[str, float] = {}
        for line in HTTP.get(f"{self.url}/metrics", timeout=30).text.splitlines():
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
            with HTTP.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(120, read=120),
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


if __name__ == "__main__":
    _drive(sys.argv[1])
