"""An operator retracts every request to the host pool and holds them; a rank is SIGKILLed, and
once the replica has replaced it, SIGKILLed again while the requests are still held. The
coordinator must replace the rank both times and serve the held requests after the resume.

The crash seen live (hyrax serve, kill -9 of a rank during `hyrax admin retract --all --mode
host_pool --hold`, then of a rank again) was the second kill: the first, on the graph that had run
the requests' steps, was recovered (the coordinator's log: 'a rank failed during a command;
recovering the replica: discard failed on a rank'). With every request held nothing runs, so the
idle replica built the new ranks' graph and parked them at once; Ray registers the coordinator
as the reader of a rank's graph output only at its first read, and Ray's own teardown of that
never-read graph after the second kill registered it then, when the dead rank's buffers had
gone: a CHECK in Ray 2.60's core worker (experimental_mutable_object_provider.cc) aborted the
coordinator, with the same log as live ('Teardown complete' of the first graph, then 'Tearing
down compiled DAG' and the CHECK). step_graph.CompiledSteps reads one park step of a new graph
before handing it out (4b46491); without that read this test fails: the coordinator dies."""
from __future__ import annotations

import time

import pytest

from hyrax.actors.engine.commands import Resume, Retract
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.selection import Selection
from ray_harness import (DEMO_MODEL, Stream, assert_clean, call, deployed, prompt, reference, replica,
                         sigkill_rank_and_wait_for_replacement, uid)

pytestmark = pytest.mark.timeout(300)

# float64: the held requests are rebuilt by prefill after the kills; their greedy tokens then
# match the uninterrupted run exactly
CONFIG = EngineConfig(deterministic=True, dtype="float64", overlap=True, compiled_graph=True)


def test_a_rank_killed_twice_while_its_requests_are_held_in_the_host_pool_is_replaced_each_time(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    prompts = [prompt(n, seed=1500 + n) for n in (9, 23)]
    want = reference(DEMO_MODEL, CONFIG, prompts, 40)
    with deployed(DEMO_MODEL, [RoleSpec("held-kill", 1, 1)], CONFIG, rank_timeout_s=20) as d:
        coord = replica(d, "held-kill").coordinator
        streams = [Stream(coord, uid(f"held{i}"), p, 40) for i, p in enumerate(prompts)]
        for s in streams:
            s.wait_tokens(4)
        assert call(coord.health)["step_path"] == "compiled graph"
        got = call(coord.run, Retract(Selection(all=True), "host_pool", True))
        assert got == {s.id: "host_pool" for s in streams}, got
        time.sleep(0.5)  # the loop has nothing to run: it parks the ranks of the graph that ran the steps
        health = sigkill_rank_and_wait_for_replacement(coord, 0)
        assert health["restarts"] == 1, health
        time.sleep(1.0)  # still held, so idle: the new ranks' graph is built and parked
        health = sigkill_rank_and_wait_for_replacement(coord, 1)
        assert health["restarts"] == 2 and not health["down"], health
        assert {r["id"] for r in call(coord.list_requests)} == {s.id for s in streams}
        got = call(coord.run, Resume(Selection(all=True)))
        assert set(got.values()) <= {"recompute", "queued", "verified"}, got  # the backups went with the ranks
        for s, tokens in zip(streams, want):
            s.wait_done(120)
            assert s.finish_reason == "length" and s.tokens == tokens, (s.id, s.finish_reason)
        assert_clean(coord)

