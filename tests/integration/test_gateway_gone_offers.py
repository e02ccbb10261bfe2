"""A gateway that goes away while it carries hand-offs leaves nothing allocated on the prefill
replica that offered them, beyond its own lease.

A prefill replica's stream of a request ends with the request's hand-off after its first token;
the gateway then carries it to a decode replica, which imports it and acknowledges to the
prefill replica, which frees the request's pages and slots. A gateway killed (or frozen) after
the hand-offs left the prefill replica and before it passed them on takes them nowhere. The
prefill replica learns the gateway is gone when the gateway's lease runs out, and aborted that
gateway's streams then, but kept the offers' state until each offer's own lease ran out
(`offer_lease_s`, 10 s by default). Measured with this test's gateway, --gateway-lease 1 s and
the default offer lease: pools back at their baseline 9.7-10.0 s after the SIGKILL before, 0.85-1.1
s with the replica freeing the offers that gateway carried when it aborts its streams, killed or
frozen alike (tests/integration/test_frozen_gateway.py: a frozen gateway's requests end with its
lease). With the default leases (both 10 s) the gateway's lease itself runs out 6.7-10 s after a
kill, so there the offers go at most a third of a lease sooner.

The gateway here is a process of its own holding a lease on the prefill replica, which streams
prompts there and keeps their hand-offs (a decode replica it never reaches); the offer lease is
set far beyond the test, so only the gateway's lease can free the offers in time."""
from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time

import pytest
import ray

from ray_harness import DEMO_CONFIG, DEMO_MODEL, assert_clean, call, deployed, replica, uid
from test_frozen_gateway import _line, _namespace

pytestmark = pytest.mark.timeout(240)

LEASE_S = 1.0  # the gateway's lease on the replica
OFFER_LEASE_S = 30.0  # each offer's own lease: what freed them before
FREED_WITHIN_S = 8.0  # past the gateway's lease (and a loaded machine's delays), well before the offers'
REQUESTS = 3
CONFIG = dataclasses.replace(DEMO_CONFIG, offer_lease_s=OFFER_LEASE_S)
GATEWAY = r"""
import asyncio, sys
from hyrax.cluster.ray_cluster import init_ray
init_ray(sys.argv[1])
import ray
from hyrax.cluster.ray_client import GatewayLease, RayBackend
coord = ray.get_actor(sys.argv[2], namespace=sys.argv[3])
lease = GatewayLease([coord], float(sys.argv[4])).start()

async def carry(backend, rid, k):
    handoff = None
    async for item in backend.generate(rid, [7 + k] * (10 + k), {"max_tokens": 50, "ignore_eos": True}):
        handoff = item.get("handoff", handoff)
    return handoff

async def main():
    backend = RayBackend(coord, "prefill", 0, gateway=lease.id)
    n = int(sys.argv[6])
    handoffs = await asyncio.gather(*(carry(backend, f"{sys.argv[5]}-{k}", k) for k in range(n)))
    print("carrying", sum(h is not None and h.get("manifest") is not None for h in handoffs), flush=True)
    await asyncio.sleep(3600)  # never passes them on: killed or frozen by the test

asyncio.run(main())
"""


@pytest.fixture(scope="module")
def prefill(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    with deployed(DEMO_MODEL, [RoleSpec("prefill", 1, 1)], CONFIG) as d:
        yield replica(d, "prefill").coordinator


def _carrying_gateway(coord, prefix: str) -> subprocess.Popen:
    """A gateway process holding the hand-offs of REQUESTS prompts it streamed on `coord`, once
    the prefill replica holds all of them offered."""
    name = ray.get(coord.__ray_call__.remote(lambda self: ray.get_runtime_context().get_actor_name()))
    ids = uid(prefix)
    proc = subprocess.Popen([sys.executable, "-c", GATEWAY, ray.get_runtime_context().gcs_address, name,
                             _namespace(coord), str(LEASE_S), ids, str(REQUESTS)],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        assert _line(proc) == f"carrying {REQUESTS}"
        states = [r["state"] for r in call(coord.list_requests) if r["id"].startswith(ids)]
        assert states == ["offered"] * REQUESTS, states
        assert sum(u["used"] for u in call(coord.pools)["components"].values()) > 0
    except BaseException:
        _end(proc)
        raise
    return proc


def _end(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.kill()
    proc.wait()


def _freed_after(coord, t0: float) -> float:
    """Seconds from `t0` until the replica is idle and clean (fails after FREED_WITHIN_S)."""
    assert_clean(coord, timeout=FREED_WITHIN_S)
    return time.monotonic() - t0


def test_the_offers_a_killed_gateway_carried_are_freed_once_its_lease_ran_out(prefill):
    reclaimed = call(prefill.stats)["offers_reclaimed"]
    proc = _carrying_gateway(prefill, "killed")
    try:
        proc.kill()  # SIGKILL: its lease is renewed no more, and its hand-offs go nowhere
        proc.wait()
        took = _freed_after(prefill, time.monotonic())
    finally:
        _end(proc)
    assert call(prefill.stats)["offers_reclaimed"] - reclaimed == REQUESTS
    print(f"pools at their baseline {took:.1f} s after the gateway was killed")


def test_the_offers_a_frozen_gateway_carries_are_freed_when_its_lease_runs_out(prefill):
    reclaimed = call(prefill.stats)["offers_reclaimed"]
    proc = _carrying_gateway(prefill, "frozen")
    try:
        os.kill(proc.pid, signal.SIGSTOP)  # its process lives on, but renews nothing
        took = _freed_after(prefill, time.monotonic())
        assert call(prefill.stats)["offers_reclaimed"] - reclaimed == REQUESTS
        assert call(prefill.health)["gateway_leases"]["expired_gateways"] >= 1
    finally:
        _end(proc)
    print(f"pools at their baseline {took:.1f} s after the gateway froze")
