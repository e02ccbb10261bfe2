"""A rank process killed (SIGKILL, as the OOM killer does) while its replica is idle and its ranks
are parked in a compiled graph that never ran a step: the coordinator replaces the rank and
serves on. It used to die with it: Ray registers the coordinator as the reader of a rank's graph
output only at its first read, and the graph's teardown after the rank's death registered it
then, after the dead rank's buffers had gone, where a CHECK in Ray's core worker aborts the
whole coordinator process (ray 2.60: "Experimental mutable object must be in the local object
store to register as reader"). The replica was lost with every request it held; with one
replica of a role, they all ended with an error."""
from __future__ import annotations

import time
from dataclasses import replace

import pytest

from ray_harness import (DEMO_CONFIG, DEMO_MODEL, assert_clean, call, deployed, prompt, reference, replica, run_all,
                         sigkill_rank_and_wait_for_replacement)

pytestmark = pytest.mark.timeout(300)


def test_a_rank_killed_while_a_fresh_graph_is_parked_is_replaced_and_the_replica_serves_on(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    config = replace(DEMO_CONFIG, compiled_graph=True)
    with deployed(DEMO_MODEL, [RoleSpec("parked-kill", 1, 1)], config, rank_timeout_s=20) as d:
        coord = replica(d, "parked-kill").coordinator
        t0 = time.monotonic()
        while call(coord.health)["step_path"] != "compiled graph":  # the idle replica built it and parked
            assert time.monotonic() - t0 < 60, call(coord.health)
            time.sleep(0.2)
        time.sleep(1.0)
        health = sigkill_rank_and_wait_for_replacement(coord, 0)
        assert health["restarts"] == 1 and not health["down"], health
        p = prompt(15, seed=1401)
        after = run_all(coord, [p], 12, prefix="after-parked-kill-")[0]
        assert after.finish_reason == "length" and after.tokens == reference(DEMO_MODEL, config, [p], 12)[0]
        assert_clean(coord)
