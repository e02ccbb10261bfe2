"""A PD deployment whose only decode replica is lost mid-stream (its coordinator killed): the
requests it was decoding are rebuilt by the prefill replica from their tokens and decoded
there to their end, with the tokens of an uninterrupted run. Before, each client got a 503
error ("the replica serving this request (decode/0) was lost, and no other decode or colocated
replica is in service to continue it") although the prefill replica, which decodes a hand-off
no decode replica takes, was in service (measured with `hyrax serve`: 16 of 16 streams)."""
from __future__ import annotations

import pytest
import ray

from pd_harness import Run, assert_outputs, coordinator, drive, pd_deployed, stats, wait_for
from ray_harness import DEMO_CONFIG, DEMO_MODEL, assert_clean, prompt, reference, uid

pytestmark = pytest.mark.timeout(300)

TOKENS = 120  # the decode replica is killed once each request has 5: the rest outlasts the kill


def test_a_lost_decode_replicas_requests_are_rebuilt_and_decoded_by_the_prefill_replica(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    prompts = [prompt(14 + i, seed=90 + i) for i in range(2)]
    want = reference(DEMO_MODEL, DEMO_CONFIG, prompts, TOKENS)
    roles = [RoleSpec("prefill", 1, 1), RoleSpec("decode", 1, 1)]
    with pd_deployed(roles, DEMO_CONFIG) as (d, client):
        runs = [Run(uid(f"lostdec{i}"), p, TOKENS) for i, p in enumerate(prompts)]

        async def kill_decode(runs):
            await wait_for(lambda: min(len(r.tokens) for r in runs) >= 5, what="5 tokens of each request")
            ray.kill(coordinator(d, "decode"), no_restart=True)
        drive(client, runs, kill_decode)
        assert_outputs(runs, want)
        prefill = coordinator(d, "prefill")
        assert stats(d, "prefill")["transfers_in"].get("recompute", 0) == 2
        assert_clean(prefill)
