"""A Ray deployment with the gateway in front of it, served by uvicorn in a daemon thread of
the bench process, and the runner for the load-generating client processes."""
from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.common import ensure_ray, progress

REPO_ROOT = Path(__file__).resolve().parents[1]


def serve_defaults():
    """The EngineConfig `hyrax serve` builds when given no engine options."""
    from hyrax.cluster.engine_args import add_engine_args, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args([]))


class GatewayStack:
    """`roles` (RoleSpecs) deployed on Ray with `config`, the gateway on 127.0.0.1."""

    def __init__(self, model_dir: str, model_name: str, roles, config, what: str):
        import httpx
        import uvicorn

        from hyrax import heap
        from hyrax.actors.cpu_claims import claimed, keep_off
        from hyrax.api.app import GatewaySettings, create_app
        from hyrax.cluster.deployment import Deployment
        from hyrax.cluster.ray_client import client_for
        from hyrax.cluster.serve import bind_gateway

        ensure_ray()
        self.model_name, self.config = model_name, config
        self.admin_token = secrets.token_urlsafe(16)
        layout = ", ".join(f"{r.name} x{r.replicas} tp={r.tp}" for r in roles)
        progress(f"{what}: starting the Ray deployment ({layout}) and the gateway")
        self.dep = Deployment(str(model_dir), list(roles), config)
        self.dep.start(timeout_s=300)
        app = create_app(client_for(self.dep, model_name), GatewaySettings(admin_token=self.admin_token))
        # the socket `hyrax serve` listens on (its options: TCP_NODELAY), not one uvicorn makes
        sock = bind_gateway("127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=2))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [sock]}, name="bench-gateway",
                                       daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("the benchmark gateway did not become healthy")
            time.sleep(0.1)
        heap.settle()  # as `hyrax serve` does once its gateway is built (hyrax/heap.py)
        # and, as it does, the gateway keeps off the CPUs the ranks claimed: every thread of this
        # process but this one, which runs the in-process baselines where the OS puts it
        self._spare = threading.get_native_id()
        self._cpus_before = keep_off(claimed(), spare=self._spare)

    def run_clients(self, module: str, job: dict, timeout_s: float = 3600) -> dict:
        """Run `python -m <module>` with `job` (plus url, model, admin token, and the CPUs the
        deployment's ranks claimed, which the clients keep off: bench/loadgen.py) on stdin; its
        JSON answer."""
        from hyrax.actors.cpu_claims import claimed

        job = {"url": self.url, "model": self.model_name, "admin_token": self.admin_token,
               "keep_off_cpus": sorted(claimed()), **job}
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
        p = subprocess.run([sys.executable, "-m", module], input=json.dumps(job), capture_output=True, text=True,
                           cwd=REPO_ROOT, env=env, timeout=timeout_s)
        if p.returncode != 0:
            raise RuntimeError(f"{module} failed: {p.stderr[-2000:]}")
        return json.loads(p.stdout)

    def flush_cache(self) -> None:
        """Evict every cached prefix (`POST /admin/flush-cache`), so that a workload sent again
        finds nothing cached from its previous run."""
        import httpx

        r = httpx.post(f"{self.url}/admin/flush-cache", headers={"Authorization": f"Bearer {self.admin_token}"},
                       timeout=30)
        r.raise_for_status()

    def close(self) -> None:
        from hyrax.actors.cpu_claims import restore

        self.server.should_exit = True
        self.thread.join(timeout=10)
        self.dep.shutdown()
        if self._cpus_before is not None:  # the ranks are gone: their CPUs are everyone's again
            restore(self._cpus_before, spare=self._spare)
