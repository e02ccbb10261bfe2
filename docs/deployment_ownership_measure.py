"""The measurements behind docs/deployment-ownership.md, on a local Ray cluster of its own.

    .venv/bin/python docs/deployment_ownership_measure.py            # detached actors only
    .venv/bin/python docs/deployment_ownership_measure.py --serve    # and Ray Serve

Ray Serve needs `grpcio-reflection` beside Ray (`pip install "ray[serve]"`); Hyrax does not
depend on it, so install it somewhere off the project's environment, e.g.
`pip install --target /tmp/serve-deps --no-deps grpcio-reflection` and `PYTHONPATH=/tmp/serve-deps`.

1. A streaming generator on a detached actor whose caller process is SIGKILLed: does the actor
   notice (its generator closed) within 20 s?
2. Actors and placement groups created *by* a detached actor, after the driver that created that
   actor exits: alive?
3. Start-up time, extra processes and memory, and per-item streaming latency (p50 over 1000
   items): a detached actor's async generator vs. a Serve deployment's streaming handle.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import time

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
import ray  # noqa: E402
from ray.util.placement_group import placement_group  # noqa: E402

ITEMS = 1000


@ray.remote(num_cpus=0, max_concurrency=100)
class Streamer:
    def __init__(self):
        self.log: list[str] = []

    async def stream(self, n: int, delay: float = 0.0):
        try:
            for i in range(n):
                if delay:
                    await asyncio.sleep(delay)
                yield i
            self.log.append("done")
        except BaseException as e:  # a closed generator shows up here
            self.log.append(f"closed: {type(e).__name__}")
            raise

    def get_log(self) -> list[str]:
        return self.log


@ray.remote(num_cpus=0)
class Leaf:
    def pid(self) -> int:
        return os.getpid()


@ray.remote(num_cpus=0)
class Owner:
    def __init__(self):
        self.pg = placement_group([{"CPU": 1}], strategy="STRICT_PACK")
        ray.get(self.pg.ready())
        self.child = Leaf.remote()

    def check(self) -> dict:
        try:
            child = ray.get(self.child.pid.remote(), timeout=5) > 0
        except Exception:  # noqa: BLE001
            child = False
        return {"child_alive": child, "placement_group": ray.util.placement_group_table(self.pg)["state"]}


def _child(mode: str, address: str) -> None:
    ray.init(address=address, namespace="measure")
    if mode == "stream":
        it = ray.get_actor("streamer").stream.remote(10**6, 0.05)
        for k, ref in enumerate(it):
            ray.get(ref)
            if k == 5:
                os.kill(os.getpid(), signal.SIGKILL)
    elif mode == "owner":
        ray.get(Owner.options(name="owner", lifetime="detached").remote().check.remote())


def _rss_mb(pattern: str) -> float:
    pids = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True).stdout.split()
    total = 0.0
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                total += next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS")) / 1024
        except (OSError, StopIteration):
            pass
    return round(total)


async def _consume(gen) -> list[float]:
    gaps, last = [], time.perf_counter()
    async for ref in gen:
        if isinstance(ref, ray.ObjectRef):
            await ref
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    return gaps


def main(serve: bool) -> dict:
    ctx = ray.init(address="local", num_cpus=2, include_dashboard=False, namespace="measure")
    address = ctx.address_info["gcs_address"]
    out: dict = {}

    s = Streamer.options(name="streamer", lifetime="detached").remote()
    ray.get(s.get_log.remote())
    subprocess.run([sys.executable, __file__, "--child", "stream", address])
    time.sleep(20)
    out["generator_after_caller_sigkill_20s"] = ray.get(s.get_log.remote()) or ["still running"]
    ray.kill(s)

    subprocess.run([sys.executable, __file__, "--child", "owner", address])
    time.sleep(5)
    out["children_of_detached_actor_after_driver_exit"] = ray.get(ray.get_actor("owner").check.remote())

    t0 = time.perf_counter()
    a = Streamer.options(name="engine", lifetime="detached").remote()
    ray.get(a.get_log.remote())
    out["actor_start_s"] = round(time.perf_counter() - t0, 2)
    asyncio.run(_consume(a.stream.remote(ITEMS)))
    out["actor_item_ms_p50"] = round(1000 * statistics.median(asyncio.run(_consume(a.stream.remote(ITEMS)))), 3)
    ray.kill(a)

    if serve:
        from ray import serve as rs

        @rs.deployment(num_replicas=1, ray_actor_options={"num_cpus": 0})
        class ServeStreamer:
            async def __call__(self, n):
                for i in range(n):
                    yield i

        t0 = time.perf_counter()
        rs.start(http_options={"host": "127.0.0.1", "port": 0})
        h = rs.run(ServeStreamer.bind(), name="engine", route_prefix=None)
        out["serve_start_and_deploy_s"] = round(time.perf_counter() - t0, 2)
        out["serve_controller_rss_mb"] = _rss_mb("ServeController")
        out["serve_proxy_rss_mb"] = _rss_mb("ProxyActor")
        stream = h.options(stream=True)
        asyncio.run(_consume(stream.remote(ITEMS)))
        out["serve_item_ms_p50"] = round(1000 * statistics.median(asyncio.run(_consume(stream.remote(ITEMS)))), 3)
        rs.shutdown()
    ray.shutdown()
    return out


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        _child(sys.argv[2], sys.argv[3])
    else:
        print(json.dumps(main("--serve" in sys.argv), indent=1))
