"""A TP rank actor dies mid-generation: the coordinator replaces its ranks and rebuilds
every in-flight request by recompute (or ends it with finish_reason "error"); no stream
hangs, the replica is healthy and clean again, and new requests succeed. A step that raises
on live ranks is not a death: its request ends with "error" and the ranks stay."""
from __future__ import annotations

import time

import pytest
import ray

from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from ray_harness import DEMO_MODEL, Stream, assert_clean, call, deployed, prompt, reference, replica, run_all, uid

pytestmark = pytest.mark.timeout(300)

# float64: the rebuilt requests resume through prefill; their greedy tokens then match the
# uninterrupted run exactly.
# Every rank's step raises once a request reaches STEP_ERROR_AT tokens of context (as an
# out-of-memory would); the kill test's requests stay far below it.
STEP_ERROR_AT = 300
CONFIG = EngineConfig(deterministic=True, dtype="float64", allow_unsafe=True,
                      faults=UnsafeFaults(step_error_at_context=STEP_ERROR_AT))


@pytest.fixture(scope="module")
def kill_tp2(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    with deployed(DEMO_MODEL, [RoleSpec("kill-tp2", 1, 2)], CONFIG, rank_timeout_s=20) as d:
        yield replica(d, "kill-tp2").coordinator


def test_killed_rank_mid_generation_recovers_every_in_flight_request(kill_tp2):
    coord = kill_tp2
    lengths, max_tokens = [5, 30, 80, 12], [40, 36, 30, 44]
    prompts = [prompt(n, seed=1000 + n) for n in lengths]
    want = reference(DEMO_MODEL, CONFIG, prompts, max_tokens)
    before = call(coord.stats)
    streams = [Stream(coord, uid(f"kill{i}"), p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    for s in streams:
        s.wait_tokens(3)
    old = call(coord.rank_handles)
    ray.kill(old[1], no_restart=True)

    t0 = time.monotonic()
    # The failure surfaces on the next step (the dead rank's call errors at once) and recovery
    # counts a restart before it starts new ranks: fail fast if it never begins.
    while call(coord.health)["restarts"] < 1:
        assert time.monotonic() - t0 < 20, f"no recovery started 20 s after the kill: {call(coord.health)}"
        time.sleep(0.1)
    for s in streams:
        s.wait_done(timeout=max(1.0, 120 - (time.monotonic() - t0)))  # none hangs
    reasons = [s.finish_reason for s in streams]
    assert set(reasons) <= {"length", "error"}, reasons
    for s, w in zip(streams, want):
        if s.finish_reason == "length":
            assert s.tokens == w, s.id  # no token lost, duplicated or changed by the rebuild
    assert reasons == ["length"] * len(streams), "ranks were restarted, so every request should finish"

    health = call(coord.health)
    assert health["healthy"] is True and health["restarts"] >= 1, health
    assert call(coord.stats)["recoveries"] - before["recoveries"] >= 1
    new = call(coord.rank_handles)
    assert len(new) == 2 and all(a != b for a, b in zip(new, old))
    assert ray.get([h.ping.remote() for h in new], timeout=30) == [0, 1]
    assert_clean(coord)

    p = prompt(15, seed=1099)
    after = run_all(coord, [p], 12, prefix="after-kill-")
    assert after[0].finish_reason == "length"
    assert after[0].tokens == reference(DEMO_MODEL, CONFIG, [p], 12)[0]
    assert_clean(coord)


def test_a_step_that_raises_on_live_ranks_fails_its_request_and_keeps_the_ranks(kill_tp2):
    coord = kill_tp2
    before, ranks = call(coord.stats), call(coord.rank_handles)
    doomed = run_all(coord, [prompt(STEP_ERROR_AT - 10, seed=1200)], 30, prefix="step-error-")[0]
    assert doomed.finish_reason == "error" and 0 < len(doomed.tokens) < 30, (doomed.finish_reason, doomed.tokens)
    after = call(coord.stats)
    assert after["step_errors"] - before["step_errors"] == 1
    assert after["recoveries"] == before["recoveries"] and call(coord.rank_handles) == ranks  # no restart
    assert call(coord.health)["healthy"] is True
    assert_clean(coord)
    p = prompt(15, seed=1201)
    again = run_all(coord, [p], 12, prefix="after-step-error-")[0]
    assert again.finish_reason == "length" and again.tokens == reference(DEMO_MODEL, CONFIG, [p], 12)[0]
    assert_clean(coord)


def test_a_rank_killed_while_the_replica_is_idle_is_replaced_before_any_request_needs_it(kill_tp2):
    """No step touches an idle replica's ranks: the loop pings them while idle, so a dead one is
    found (health says so and counts the restart) and replaced before the next request."""
    coord = kill_tp2
    before = call(coord.health)["restarts"]
    old = call(coord.rank_handles)
    time.sleep(1.0)  # idle long enough for its one idle pool check (which calls the ranks too) to be over
    ray.kill(old[0], no_restart=True)
    t0 = time.monotonic()
    while call(coord.health)["restarts"] == before:
        assert time.monotonic() - t0 < 15, f"an idle replica's dead rank went unnoticed for 15 s: {call(coord.health)}"
        time.sleep(0.1)
    while not call(coord.health)["healthy"]:
        assert time.monotonic() - t0 < 120, f"the ranks were not replaced: {call(coord.health)}"
        time.sleep(0.2)
    health = call(coord.health)
    assert health["restarts"] == before + 1 and "ping failed on a rank" in health["last_error"], health
    new = call(coord.rank_handles)
    assert all(a != b for a, b in zip(new, old)) and ray.get([h.ping.remote() for h in new], timeout=30) == [0, 1]
    assert_clean(coord)
    p = prompt(15, seed=1301)
    after = run_all(coord, [p], 12, prefix="after-idle-kill-")[0]
    assert after.finish_reason == "length" and after.tokens == reference(DEMO_MODEL, CONFIG, [p], 12)[0]
    assert call(coord.health)["restarts"] == before + 1  # the request found working ranks
