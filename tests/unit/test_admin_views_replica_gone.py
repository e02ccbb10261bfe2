"""The gateway's views of its replicas (/metrics, /admin/pools, /admin/requests, the dashboard)
answer while one replica is gone, with the replicas that answered.

Seen live (hyrax serve --colocated --replicas 2, kill -9 of one replica's coordinator): for the
~3 s until the gateway learned of the replacement, /metrics, /admin/pools and /admin/requests
were 500s, since asking the dead actor raised ActorDiedError through them; a Prometheus scrape
lost every series, the refusal counters and the surviving replica's pools included, exactly when
a replica died. A replica that does not answer now has no series (no row) in that answer; its
health (hyrax_replica_healthy 0, /health, /admin/health) says why. Only a replica that is gone
or gave no answer in time is left out: any other exception is a bug and still a 500
(test_internal_errors_hidden)."""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import ray

from gateway_fakes import Replica, gateway
from hyrax.actors.engine.commands import FlushCache, ListRequests, Pools, SetForcedRetraction, Stats
from hyrax.cluster.ray_client import RayBackend

AUTH = {"Authorization": "Bearer t"}
POOL = {"full_kv": {"capacity": 8, "used": 2, "cached": 1, "host_capacity": 4, "host_used": 0}}
STATS = {"prompt_tokens": 5, "generation_tokens": 7, "checksum_failures": 0, "finished": {"length": 1},
         "retractions_by": {}, "restores_by": {}}


class Gone(Replica):
    """A replica whose coordinator actor died: every call to it raises as Ray's does."""

    unreachable = RayBackend(None, "colocated", 0).unreachable

    def __init__(self, index: int):
        self.index = index

    async def run(self, cmd):
        raise ray.exceptions.ActorDiedError()

    async def health(self) -> dict:
        raise ray.exceptions.ActorDiedError()


class Answering(Replica):
    def __init__(self, index: int):
        self.index = index

    async def run(self, cmd):
        match cmd:
            case Pools(): return dict(POOL)
            case Stats(): return dict(STATS)
            case ListRequests(): return [{"id": "r1", "state": "running"}]
            case FlushCache(): return {"full_kv": 3}
            case SetForcedRetraction(): return None
        raise AssertionError(cmd)


def test_views_answer_with_the_replicas_that_answered_while_one_is_gone():
    c = gateway(replicas=[Gone(0), Answering(1)])
    pools = c.get("/admin/pools", headers=AUTH)
    assert pools.status_code == 200, pools.text
    assert [(p["replica"], p["components"]) for p in pools.json()["replicas"]] == [(1, POOL)]
    reqs = c.get("/admin/requests", headers=AUTH)
    assert reqs.status_code == 200, reqs.text
    assert [(r["id"], r["replica"]) for r in reqs.json()["requests"]] == [("r1", 1)]
    metrics = c.get("/metrics")
    assert metrics.status_code == 200, metrics.text
    text = metrics.text
    assert 'hyrax_pool_usage_ratio{component="full_kv",rank="0",replica="1",role="colocated"} 0.25' in text
    assert 'hyrax_generation_tokens_total{replica="1",role="colocated"} 7.0' in text
    assert 'replica="0"' in text and 'hyrax_replica_healthy{replica="0",role="colocated"} 0.0' in text
    assert 'hyrax_pool_usage_ratio{component="full_kv",rank="0",replica="0"' not in text
    assert "hyrax_router_refusals_total" in text
    summary = c.get("/dashboard/summary")
    assert summary.status_code == 200, summary.text
    assert [r["replica"] for r in summary.json()["replicas"]] == [1]


def test_a_ray_replica_is_unreachable_when_its_actor_died_or_gave_no_answer_in_time():
    unreachable = RayBackend(None, "colocated", 0).unreachable
    for e in (ray.exceptions.ActorDiedError(), ray.exceptions.ActorUnavailableError("", None), TimeoutError()):
        assert isinstance(e, unreachable), e
    assert not isinstance(ValueError("a bug"), unreachable)


def test_flush_and_forced_retraction_reach_the_replicas_that_answer_and_name_the_one_gone():
    """An operator's cache flush or forced-retraction setting was a 500 while one replica was
    gone, though every other replica had taken it: the answer now says which took it."""
    c = gateway(replicas=[Gone(0), Answering(1)])
    flush = c.post("/admin/flush-cache", headers=AUTH)
    assert flush.status_code == 200, flush.text
    assert flush.json()["replicas"] == [{"role": "colocated", "replica": 0, "reached": False},
                                        {"role": "colocated", "replica": 1, "reached": True, "freed": {"full_kv": 3}}]
    forced = c.post("/admin/forced-retraction", json={"interval": 3}, headers=AUTH)
    assert forced.status_code == 200, forced.text
    assert forced.json() == {"interval": 3, "replicas": [{"role": "colocated", "replica": 0, "reached": False},
                                                         {"role": "colocated", "replica": 1, "reached": True}]}
