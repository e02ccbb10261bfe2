"""A gateway process that freezes (SIGSTOP, a node that stops answering) for longer than its lease
must not take the replicas it streams from with it. The replica aborts the frozen gateway's
requests when its lease runs out; before, it also ended that gateway's feed at once, and Ray
ends a streaming generator by waiting, on the actor's event loop, until the caller has
acknowledged every item it was sent: a frozen caller never does, so the replica's event loop
stood still (no health answer, no other gateway's tokens) until the gateway went on, and the
deployment's controller killed the replica as hung after --hung-replica-timeout (measured with
two `hyrax serve` gateways: every stream of the other gateway on that replica was cut).

Now a lapsed gateway's feed stays open until its process is known gone (its Ray job dead: its
unanswered items then fail at once) or it renews again (it reads the feed again)."""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import ray

from hyrax.actors.engine.commands import Abort
from ray_harness import Stream, assert_clean, prompt, replica, uid
from test_feed_cleanup import _feeds, _settles_at

LEASE_S = 1.0
GATEWAY = r"""
import asyncio, sys
from hyrax.cluster.ray_cluster import init_ray
init_ray(sys.argv[1])
import ray
from hyrax.cluster.ray_client import GatewayLease, RayBackend
coord = ray.get_actor(sys.argv[2], namespace=sys.argv[3])
lease = GatewayLease([coord], float(sys.argv[4])).start()

async def main():
    backend = RayBackend(coord, "colocated", 0, gateway=lease.id)
    tokens, last = 0, None
    async for item in backend.generate(sys.argv[5], list(range(1, 13)), {"max_tokens": 4000, "ignore_eos": True}):
        tokens += len(item.get("token_ids") or ())
        if tokens and last is None:
            print("streaming", flush=True)
        last = item
    print("ended", last.get("finish_reason"), bool(last.get("error")), flush=True)
    await asyncio.sleep(3600)  # stays connected until killed

asyncio.run(main())
"""


def _answer_time(coord, timeout: float = 5.0) -> float:
    """Seconds the replica takes to answer a health call (`timeout` if it does not in time)."""
    t0 = time.monotonic()
    try:
        ray.get(coord.health.remote(), timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        return timeout
    return time.monotonic() - t0


def test_a_frozen_gateway_past_its_lease_leaves_the_replica_answering_and_another_gateway_streaming(demo_deployment):
    rep = replica(demo_deployment, "tp1")
    coord = rep.coordinator
    name = ray.get(coord.__ray_call__.remote(lambda self: ray.get_runtime_context().get_actor_name()))
    base = _settles_at(coord, _feeds(coord), 0)
    rid = uid("frozen")
    proc = subprocess.Popen([sys.executable, "-c", GATEWAY, ray.get_runtime_context().gcs_address, name,
                             _namespace(coord), str(LEASE_S), rid],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert _line(proc) == "streaming"
        alive = uid("gw-alive")
        ray.get(coord.renew_gateway.remote(alive, 30.0))
        other = Stream(coord, uid("other"), prompt(12, 2), 4000, gateway=alive)
        other.wait_tokens(1)
        os.kill(proc.pid, signal.SIGSTOP)
        slowest, t_end = 0.0, time.monotonic() + 6 * LEASE_S  # its lease runs out meanwhile
        got = len(other.tokens)
        while time.monotonic() < t_end:
            slowest = max(slowest, _answer_time(coord))
            time.sleep(0.2)
        assert ray.get(coord.health.remote(), timeout=30)["gateway_leases"]["aborted_streams"] >= 1
        assert slowest < 2.0, f"the replica answered health only after {slowest:.1f} s while a gateway was frozen"
        # the other gateway's stream went on: tokens came, nothing cut it (on a fast machine it
        # may reach the model's context limit within the window and end by `length`, as it should)
        progressed = len(other.tokens) - got
        assert progressed > 0 and other.error is None and other.finish_reason in (None, "length"), \
            (progressed, other.finish_reason, other.error)
        os.kill(proc.pid, signal.SIGCONT)
        # its stream ends with the lease's abort, an error its client sees; nothing after it
        assert _line(proc).split() == ["ended", "abort", "True"]
        ray.get(coord.run.remote(Abort(other.id)))
        other.wait_done(30)
        # the gateway's process goes: its feed goes with it
        proc.kill()
        proc.wait()
        assert _settles_at(coord, base) == base
        assert_clean(coord)
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait()


def _line(proc, timeout: float = 60.0) -> str:
    """The gateway process's next line, or a failure after `timeout` (a frozen replica never lets
    its stream end: the test fails instead of hanging until pytest's own timeout)."""
    if not select.select([proc.stdout], [], [], timeout)[0]:
        raise AssertionError(f"the gateway process wrote no line in {timeout:g} s")
    return proc.stdout.readline().strip()


def _namespace(coord) -> str:
    return ray.get(coord.__ray_call__.remote(lambda self: ray.get_runtime_context().namespace))
