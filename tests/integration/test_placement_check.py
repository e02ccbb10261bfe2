"""A deployment that cannot fit the cluster fails within seconds, before anything is placed,
naming what is missing — instead of waiting on a placement group that can never be placed."""
from __future__ import annotations

import time

import pytest
import ray
from ray.util.placement_group import placement_group, placement_group_table, remove_placement_group

from ray_harness import DEMO_CONFIG, DEMO_MODEL


def _free_cpus() -> float:
    return ray.available_resources().get("CPU", 0)


@pytest.fixture
def one_cpu_free(ray_session):
    """Reserve all but one of the cluster's CPUs, as other jobs on a shared cluster would.

    Sized from the cluster's total, not from what is free right now: a previous module's actors
    may still be releasing CPUs, which would leave more than one free once they are gone."""
    before = ray.cluster_resources().get("CPU", 0)
    squat = int(before) - 1
    pg = placement_group([{"CPU": 1}] * squat, strategy="SPREAD", name="test/squatter") if squat > 0 else None
    if pg is not None:
        ray.get(pg.ready(), timeout=60)
    deadline = time.monotonic() + 10
    while _free_cpus() != 1 and time.monotonic() < deadline:  # the resource view catches up
        time.sleep(0.05)
    assert _free_cpus() == 1
    yield
    if pg is not None:
        remove_placement_group(pg)
    deadline = time.monotonic() + 10
    while _free_cpus() < before and time.monotonic() < deadline:  # the next test sees them free again
        time.sleep(0.05)


def _hyrax_groups(prefix: str) -> list[str]:
    return [g["name"] for g in placement_group_table().values()
            if g["name"].startswith(prefix) and g["state"] != "REMOVED"]


def test_deployment_that_cannot_fit_fails_in_seconds_naming_what_is_missing(one_cpu_free):
    from hyrax.actors.model.errors import StartupFailure
    from hyrax.cluster.deployment import Deployment, RoleSpec

    dep = Deployment(DEMO_MODEL, [RoleSpec("fitcheck", 1, 2)], DEMO_CONFIG)
    t0 = time.monotonic()
    try:
        with pytest.raises(StartupFailure) as err:
            dep.start(timeout_s=20)  # the old code waited here until the timeout
    finally:
        dep.shutdown()
    assert time.monotonic() - t0 < 5
    msg = str(err.value)
    assert "\n" not in msg
    assert "needs 2 CPU in bundles of 1" in msg and "fitcheck/0: 2" in msg, msg
    assert "the cluster has 1 CPU free" in msg and "fitcheck/0 would wait forever" in msg, msg
    assert _hyrax_groups("hyrax/fitcheck") == [] and dep.replicas == []  # nothing was placed



def test_placement_wait_rechecks_for_room_until_its_deadline(one_cpu_free):
    from hyrax.actors.model.errors import StartupFailure
    from hyrax.cluster.deployment import Deployment, RoleSpec

    dep = Deployment(DEMO_MODEL, [RoleSpec("fitwait", 1, 2)], DEMO_CONFIG)
    t0 = time.monotonic()
    with pytest.raises(StartupFailure, match="fitwait/0 would wait forever"):
        dep.start(timeout_s=20, wait_for_room_s=2)
    assert 2 <= time.monotonic() - t0 < 8
    assert _hyrax_groups("hyrax/fitwait") == [] and dep.replicas == []
