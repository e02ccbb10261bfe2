"""A replica whose ranks keep failing gives up after its own restarts (its requests end with
"error") and says so in its health ("down"). It used to stay listed for ever, out of service in
every gateway and serving nothing, while the deployment counted it as one of its replicas: the
controller now stops it and places a new one, which serves."""
from __future__ import annotations

import asyncio
import time

import pytest
import ray

from hyrax.actors.engine.config import EngineConfig
from hyrax.cluster import controller
from hyrax.cluster.placement import RoleSpec
from hyrax.cluster.serve import _events_of
from hyrax.cluster.supervision import Supervision
from ray_harness import DEMO_MODEL, assert_clean, call, prompt, reference, run_all

pytestmark = pytest.mark.timeout(300)
CONFIG = EngineConfig(deterministic=True)


def _until(cond, what: str, timeout_s: float):
    deadline = time.monotonic() + timeout_s
    while not (got := cond()):
        assert time.monotonic() < deadline, what
        time.sleep(0.2)
    return got


def _health_or_gone(coord) -> dict | None:
    """The replica's health; None once the controller has stopped it (it may do so between two
    polls: down, then killed within its half-second check interval)."""
    try:
        return call(coord.health)
    except ray.exceptions.RayActorError:
        return None


def test_a_replica_whose_ranks_cannot_be_kept_alive_is_replaced_by_the_controller(ray_session):
    ctl = controller.create("downrep", DEMO_MODEL, "demo", [RoleSpec("colocated", 1, 1)], CONFIG,
                            rank_timeout_s=30, attach=False, supervision=Supervision(interval_s=0.5))
    try:
        [first] = controller.ensure(ctl).replicas
        coord = first.coordinator
        while (h := _health_or_gone(coord)) is not None and not h["down"]:  # its ranks lost after each restart
            before = h["restarts"]
            [rank] = call(coord.rank_handles)
            ray.kill(rank, no_restart=True)
            _until(lambda: (g := _health_or_gone(coord)) is None or g["down"] or (g["restarts"] > before and g["healthy"]),
                   "the idle replica never noticed its lost rank", 60)
        [second] = _until(lambda: [r for r in ray.get(ctl.replicas.remote()) if r.index != first.index],
                          f"the down replica was not replaced: {ray.get(ctl.events.remote())}", 120)
        events = ray.get(ctl.events.remote())
        assert f"down colocated/{first.index}: its ranks could not be restarted; stopped" in events, events
        assert f"replaced a lost colocated replica with colocated/{second.index}" in events, events
        assert [r.index for r in ray.get(ctl.replicas.remote())] == [second.index]  # the down one is gone
        # what an operator reads of it (GET /admin/events), through the source hyrax serve gives the gateway
        page = asyncio.run(_events_of(ctl)())
        told = [e.what for e in page.events]
        assert told == events and page.total == len(events), (told, events)
        assert all(a.at <= b.at for a, b in zip(page.events, page.events[1:])) and page.events[-1].at <= time.time()
        with pytest.raises(ray.exceptions.RayActorError):
            ray.get(coord.health.remote(), timeout=30)
        p = prompt(15, seed=1401)
        out = run_all(second.coordinator, [p], 12, prefix="after-down-")[0]
        assert out.finish_reason == "length" and out.tokens == reference(DEMO_MODEL, CONFIG, [p], 12)[0]
        assert_clean(second.coordinator)
    finally:
        controller.tear_down(ctl)
