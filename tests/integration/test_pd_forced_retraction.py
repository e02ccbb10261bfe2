"""Forced retraction during a PD run: every third step a request is retracted on each
replica (prefill and decode), backed up on every rank, and restored verified; greedy outputs
stay equal to the single-process engine's, token for token. With and without overlap
scheduling (the default of `hyrax serve`)."""
from __future__ import annotations

import pytest

from hyrax.actors.engine.config import EngineConfig
from pd_harness import Run, assert_all_clean, assert_outputs, drive, pd_deployed, stats, stats_delta
from ray_harness import DEMO_MODEL, prompt, reference, uid

pytestmark = pytest.mark.timeout(300)

# 300 and 520 exceed the prefill chunk (256): their prompts take several steps on the prefill
# replica, so forced retraction can strike there mid-prompt too
LENGTHS = [10, 40, 70, 150, 300, 520]
MAX = [24, 20, 28, 16, 22, 18]


def test_pd_forced_retraction_on_decode_keeps_outputs_and_restores_verified(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    config = EngineConfig(deterministic=True, forced_retraction_interval=3)
    prompts = [prompt(n, seed=1200 + n) for n in LENGTHS]
    want = reference(DEMO_MODEL, config, prompts, MAX)
    with pd_deployed([RoleSpec("prefill", 1, 1), RoleSpec("decode", 1, 2)], config) as (d, client):
        before = stats(d, "decode")
        runs = drive(client, [Run(uid(f"forced-{i}"), p, m) for i, (p, m) in enumerate(zip(prompts, MAX))])
        assert_outputs(runs, want)
        dd = stats_delta(before, stats(d, "decode"))
        assert dd["transfers_in"].get("verified") == len(runs), dd["transfers_in"]
        assert dd["retractions"] > 0, dd
        assert dd["retractions_by"].get("forced/cpu_tensor", 0) == dd["retractions"], dd["retractions_by"]
        # every retraction came back verified: nothing was rebuilt, no checksum failed
        # (PD imports are counted as transfers, not restores)
        assert dd["restores"] == dd["retractions"], (dd["restores"], dd["retractions"])
        assert dd["restore_fallbacks"] == 0 and dd["checksum_failures"] == 0
        assert dd["bytes_restored"] and all(v > 0 for v in dd["bytes_restored"].values()), dd["bytes_restored"]
        assert_all_clean(d)
