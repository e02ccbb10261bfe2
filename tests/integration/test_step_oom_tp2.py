"""Out of memory in a step over Ray, TP=2 (issue 18): both rank actors run a step of more than
two requests and then raise `torch.OutOfMemoryError`; the coordinator receives it as a typed
`StepOutOfMemory` through Ray, lowers its batch cap and rebuilds those requests. Every request
finishes with the single-process reference's tokens, the ranks are the same actors (no
restart), and the pools are clean."""
from __future__ import annotations

import pytest

from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from ray_harness import DEMO_MODEL, assert_clean, call, deployed, prompt, reference, replica, run_all

pytestmark = pytest.mark.timeout(300)

# float64: rebuilt requests resume through prefill; their greedy tokens then match exactly
CONFIG = EngineConfig(deterministic=True, dtype="float64", allow_unsafe=True,
                      faults=UnsafeFaults(oom_above_requests=2))


@pytest.fixture(scope="module")
def oom_tp2(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    with deployed(DEMO_MODEL, [RoleSpec("oom-tp2", 1, 2)], CONFIG, rank_timeout_s=30) as d:
        yield replica(d, "oom-tp2").coordinator


def test_out_of_memory_over_ray_shrinks_the_batch_and_keeps_the_ranks(oom_tp2):
    coord = oom_tp2
    ranks = call(coord.rank_handles)
    prompts = [prompt(n, seed=1300 + n) for n in (6, 17, 25, 9, 30, 12)]
    want = reference(DEMO_MODEL, CONFIG, prompts, 24)
    got = run_all(coord, prompts, 24, prefix="oom-")
    assert [s.finish_reason for s in got] == ["length"] * len(prompts)
    assert [s.tokens for s in got] == want
    s = call(coord.stats)
    cap = s["batch_cap"]
    assert cap["out_of_memory_steps"] >= 1 and cap["rebuilt"] >= 1 and cap["failed"] == 0, cap
    assert s["step_errors"] == 0 and s["recoveries"] == 0, s
    health = call(coord.health)
    assert health["restarts"] == 0 and health["healthy"] is True, health
    assert call(coord.rank_handles) == ranks  # the same actors: nothing was restarted
    assert_clean(coord)
