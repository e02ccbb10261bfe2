"""A PD transfer whose bytes were corrupted after checksumming on the prefill side is caught
by the decode replica's per-shard checksum check, rebuilt there by prefill (recompute), and
the request's output is still the single-process engine's, token for token. The mutation
check (verification off: the corruption goes unnoticed and the output changes) is in
test_pd_checksum_mutation.py: it needs a PD deployment of its own, and two cannot coexist.
"""
from __future__ import annotations

import pytest

from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from pd_harness import Run, assert_all_clean, assert_outputs, decode_on, drive, pd_deployed, stats, stats_delta
from ray_harness import DEMO_MODEL, prompt, reference, replica, uid

pytestmark = pytest.mark.timeout(300)

LENGTHS, MAX = [20, 150], 12  # shorter and longer than the sliding window (64)


def _prompts(seed: int) -> list[list[int]]:
    return [prompt(n, seed=seed + n) for n in LENGTHS]


@pytest.fixture(scope="module")
def corrupting_pd(demo_deployment):
    """Prefill TP=2 whose rank 1 corrupts its mamba_ssm shard after checksumming it; decode
    targets TP=1 ("decode") and TP=2 ("colocated"), so the shards are re-sharded 2 -> 1 and
    kept 2 -> 2. The faults apply to every role, but only the prefill replica exports. The
    "colocated" target is the session demo deployment's TP=2 replica, borrowed: it only
    imports, so the faults would not touch it, and it verifies and rebuilds like any importer
    (it runs overlap scheduling, the `hyrax serve` default; the "decode" target does not)."""
    from hyrax.cluster.deployment import RoleSpec

    faults = UnsafeFaults(corrupt_backup_component="mamba_ssm", only_rank=1)
    config = EngineConfig(deterministic=True, faults=faults, allow_unsafe=True)
    roles = [RoleSpec("prefill", 1, 2), RoleSpec("decode", 1, 1)]
    with pd_deployed(roles, config, borrowed={"colocated": replica(demo_deployment, "tp2")}) as (d, client):
        yield d, client, config


@pytest.mark.parametrize("role,decode_tp", [("decode", 1), ("colocated", 2)])
def test_pd_corrupted_transfer_is_detected_and_reprefilled_with_correct_output(corrupting_pd, role, decode_tp):
    d, client, config = corrupting_pd
    assert next(r.tp for r in d.replicas if r.role == role) == decode_tp
    prompts = _prompts(700)
    want = reference(DEMO_MODEL, config, prompts, MAX)
    with decode_on(client, client.find_backend(role, 0)):
        before = stats(d, role)
        before_p = stats(d, "prefill")
        runs = drive(client, [Run(uid(f"corrupt-{role}-{i}"), p, MAX) for i, p in enumerate(prompts)])
    assert_outputs(runs, want)
    dd = stats_delta(before, stats(d, role))
    assert dd["transfers_in"] == {"checksum_mismatch": len(prompts)}, dd["transfers_in"]
    assert dd["checksum_failures"] == len(prompts)
    assert dd["restore_fallbacks"] == 0  # a failed import is a transfer result, not a restore
    # nothing was counted as transferred: the state was rebuilt, not imported
    assert not any(dd["bytes_transferred"].values()), dd["bytes_transferred"]
    # the decode side produced every token but the prefill replica's first one
    assert dd["generation_tokens"] == len(prompts) * (MAX - 1)
    assert stats_delta(before_p, stats(d, "prefill"))["transfers_out"] == len(prompts)
    assert_all_clean(d)
