"""--gpu-memory-fraction over Ray, TP=2 (issue 18): each rank loads its shard, runs the
profiling forward (with its all-reduces) and measures its device; the coordinator takes the
smallest capacities over the ranks, every rank allocates pools of those shapes, and the
replica serves exactly. The ranks run on CPU, so each is given a stand-in device (test-only,
refused without allow_unsafe): rank 1's has more memory in use, so its budget decides."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from hyrax.actors.engine.memory_budget import capacities
from hyrax.actors.engine.pools import pool_sizes_for
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.sharding import TP
from hyrax.actors.model.state import derive_components
from ray_harness import DEMO_MODEL, assert_clean, call, deployed, prompt, reference, replica, run_all

pytestmark = pytest.mark.timeout(300)

MiB = 2**20
FRACTION = 0.5
DEVICES = ((64 * MiB, 8 * MiB, 1 * MiB), (64 * MiB, 16 * MiB, 1 * MiB))  # (total, used, activation peak)
CONFIG = EngineConfig(deterministic=True, dtype="float64", gpu_memory_fraction=FRACTION, allow_unsafe=True,
                      faults=UnsafeFaults(stand_in_memory=DEVICES))


def test_ranks_agree_on_the_smallest_budget_and_serve_exactly(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    with deployed(DEMO_MODEL, [RoleSpec("mem-tp2", 1, 2)], CONFIG) as d:
        _check_sized_replica(replica(d, "mem-tp2").coordinator)


def _check_sized_replica(coord) -> None:
    cfg = ModelConfig.from_dir(DEMO_MODEL)
    per_rank = []
    for r, (total, used, peak) in enumerate(DEVICES):
        comps = derive_components(cfg, TP(r, 2), torch.float64)
        per_rank.append(capacities(comps, CONFIG, int(FRACTION * total) - used - peak))
    assert per_rank[1]["mamba_slots"] < per_rank[0]["mamba_slots"]  # rank 1 has less room
    sized = dataclasses.replace(CONFIG, **per_rank[1])
    want = pool_sizes_for(derive_components(cfg, TP(0, 2), torch.float64), sized)
    pools = call(coord.pools)["components"]
    assert {n: p["capacity"] for n, p in pools.items() if n in want.units} == want.units
    assert pools["mamba_ssm.checkpoint"]["capacity"] == 3 * per_rank[1]["mamba_slots"]
    health = call(coord.health)
    assert len(health["memory"]) == 2 and "leaves" in health["memory"][1], health["memory"]

    prompts = [prompt(n, seed=1400 + n) for n in (7, 23, 40)]
    got = run_all(coord, prompts, 16, prefix="mem-")
    assert [s.tokens for s in got] == reference(DEMO_MODEL, CONFIG, prompts, 16)
    assert_clean(coord)
