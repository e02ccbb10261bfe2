"""The same scenarios over the Ray-backed engine client (one colocated TP=1 replica): a
gateway in this process, the engine in a RoleCoordinator actor and its rank actor."""
from __future__ import annotations

import asyncio

import pytest
import ray

from e2e_harness import (
    DISCONNECT_MAX_TOKENS, admin_retractions, check_streams_match_reference, disconnect_mid_stream, finished_count,
    reference_outputs, streams_under_retraction, wait_until,
)

pytestmark = pytest.mark.timeout(300)


def replica_stats(stack) -> dict:
    [rep] = stack.deployment.replicas
    return ray.get(rep.coordinator.stats.remote(), timeout=30)


def check_clean(stack) -> None:
    wait_until(stack.is_idle, 20, interval=0.2, what="the replica to be idle with empty pools")
    [rep] = stack.deployment.replicas
    assert ray.get(rep.coordinator.check_invariants.remote(), timeout=30)


def test_32_streams_under_admin_retraction_match_the_uninterrupted_run_over_ray(ray_stack):
    ref = reference_outputs(ray_stack.url, ray_stack.client)
    before = replica_stats(ray_stack)
    since = len(ray_stack.client.requests)

    results, seen = asyncio.run(streams_under_retraction(ray_stack.url, n_streams=32, seed=11))

    check_streams_match_reference(results, ref, ray_stack.client, since)
    assert seen["cpu_tensor"] > 0 and seen["host_pool"] > 0, seen
    assert seen["held"] > 0 and seen["resumed"] == seen["held"], seen
    after = replica_stats(ray_stack)
    for mode in ("cpu_tensor", "host_pool"):
        assert admin_retractions(after, mode) - admin_retractions(before, mode) == seen[mode]
    assert after["checksum_failures"] == before["checksum_failures"]
    check_clean(ray_stack)


@pytest.mark.parametrize("path,n", [("/v1/completions", 1), ("/v1/chat/completions", 2)])
def test_disconnect_mid_stream_aborts_the_request_and_frees_every_pool_over_ray(ray_stack, path, n):
    aborted = finished_count(replica_stats(ray_stack), "abort")
    since = len(ray_stack.client.requests)

    disconnect_mid_stream(ray_stack.url, path, n)

    check_clean(ray_stack)
    assert finished_count(replica_stats(ray_stack), "abort") == aborted + n
    recs = list(ray_stack.client.requests.values())[since:]
    assert all(r["finish_reason"] is None and len(r["tokens"]) < DISCONNECT_MAX_TOKENS for r in recs)
