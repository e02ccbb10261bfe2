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
    """Reserve all but one of the cluster's free CPUs, as other jobs on a shared cluster would.

    A previous module's actors may still be releasing CPUs (and the session's shared
    deployment holds some for good), so squat on what is free, then on whatever frees up
    after, until exactly one CPU has stayed free for a second."""
    before, squats = _free_cpus(), []
    try:
        deadline, stable_since = time.monotonic() + 120, None
        while True:
            free = _free_cpus()
            if free > 1:
                pg = placement_group([{"CPU": 1}] * int(free - 1), strategy="SPREAD")
                squats.append(pg)
                ray.get(pg.ready(), timeout=60)
                stable_since = None
            elif free == 1:
                stable_since = stable_since or time.monotonic()
                if time.monotonic() - stable_since >= 1.0:
                    break
            assert time.monotonic() < deadline, f"could not leave exactly one CPU free (free: {free})"
            time.sleep(0.1)
        yield
    finally:
        for pg in squats:
            remove_placement_group(pg)
    deadline = time.monotonic() + 30
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
