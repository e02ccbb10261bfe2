"""A prefix-cache checkpoint that changed on one rank of a TP=2 replica (Ray, gloo): both ranks
raise inside the step that would copy it (the verdicts are summed over the group, so the intact
rank does not enter the forward alone), the hit is revoked and the request recomputes: the
same greedy tokens as the uninterrupted reference, nothing failed, every pool back to baseline."""
from __future__ import annotations

import pytest
import ray

from ray_harness import DEMO_CONFIG, DEMO_MODEL, assert_clean, call, prompt, reference, run_all, stats_delta

pytestmark = pytest.mark.timeout(300)


def test_a_checkpoint_changed_on_one_rank_is_caught_by_both_and_the_request_recomputes(demo_tp2):
    coord = demo_tp2
    p = prompt(600, seed=777)  # deterministic mode: a hit at the 512-token chunk cut, on a checkpoint
    want = reference(DEMO_MODEL, DEMO_CONFIG, [p], 8)[0]
    [first] = run_all(coord, [p], 8, prefix="hitcheck-first-")
    assert first.tokens == want
    before = call(coord.stats)
    [hit] = run_all(coord, [p], 8, prefix="hitcheck-hit-")
    d = stats_delta(before, call(coord.stats))
    assert hit.tokens == want and d["prefix_cache"].get("hits", 0) >= 1, d  # the repeat hits
    def change_checkpoints(rank_worker) -> int:
        """Runs inside a rank actor (defined here: shipped by value): every cached recurrent
        state of this rank's shard changes."""
        with rank_worker._turn:
            pools = [p for name, p in rank_worker.runtime.pools.items() if name.endswith(".checkpoint")]
            for p in pools:
                p += 1.0
            return len(pools)

    ranks = call(coord.rank_handles)
    assert ray.get(ranks[1].__ray_call__.remote(change_checkpoints), timeout=60) > 0  # rank 1 only
    before = call(coord.stats)
    [again] = run_all(coord, [p], 8, prefix="hitcheck-changed-")
    d = stats_delta(before, call(coord.stats))
    assert again.tokens == want and again.finish_reason == "length"
    assert d["prefix_cache"].get("corrupt_checkpoints", 0) >= 1 and d["prefix_cache"].get("hits", 0) <= 0, d
    assert d.get("step_errors", 0) == 0 and d.get("finished", {}).get("error", 0) == 0, d
    assert d.get("recoveries", 0) == 0, d  # no rank was left waiting in a collective and replaced
    assert_clean(coord)
