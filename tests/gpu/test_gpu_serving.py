"""CUDA runs of what a deployment does beyond per-request greedy steps (skipped without CUDA):
batched non-greedy steps, overlap scheduling, a hand-off between engines, bfloat16 against
float32, TP = 2 over NCCL on Ray, and `hyrax doctor`'s own checks (the doctor and these tests
share them). Bodies: serving_checks.py, which also runs them on the CPU."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import serving_checks as sc
from hyrax.actors.engine.config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))  # the Ray test harness

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

FP32 = EngineConfig(dtype="float32")
DET32 = EngineConfig(deterministic=True, dtype="float32")


def _near(a: list[list[int]], b: list[list[int]], allowed: int = 1) -> None:
    """Equal but for at most `allowed` requests (a TF32/kernel difference may flip a near-tie)."""
    differ = sum(x != y for x, y in zip(a, b))
    assert differ <= allowed, (a, b)


def test_batched_seeded_sampling_on_cuda_matches_the_cpu():
    _near(sc.run("cuda", FP32, sc.sampled), sc.run("cpu", FP32, sc.sampled))


def test_batched_greedy_steps_on_cuda_match_the_cpu():
    _near(sc.run("cuda", FP32), sc.run("cpu", FP32))


def test_overlap_on_cuda_equals_steps_without_it():
    assert sc.run("cuda", EngineConfig(deterministic=True, dtype="float32", overlap=True)) == sc.run("cuda", DET32)


def test_handoff_between_cuda_engines_equals_the_uninterrupted_run():
    assert sc.handed_off("cuda", DET32) == sc.run("cuda", DET32)


def test_bfloat16_tracks_float32_on_cuda():
    bf16, fp32 = sc.run("cuda", EngineConfig(dtype="bfloat16")), sc.run("cuda", FP32)
    shared = sc.agreement(bf16, fp32)
    # bf16 rounding can flip a near-tie at some point; it must not change the run from the start
    assert sum(n >= 4 for n in shared) >= len(shared) - 1, shared


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_tp2_over_nccl_on_ray_matches_the_cpu_engine():
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray = pytest.importorskip("ray", reason="needs Ray (a GPU host's image may lack it: the other tests here do not)")
    from ray_harness import replica, run_all

    from hyrax.actors.model.demo import DEMO_DIR
    from hyrax.cluster.deployment import Deployment, RoleSpec
    from hyrax.cluster.ray_cluster import init_ray

    started = init_ray(num_cpus=8, dashboard=False, num_gpus=2)
    config = EngineConfig(deterministic=True, dtype="float32", overlap=True, compiled_graph=True)
    d = Deployment(str(DEMO_DIR), [RoleSpec("gpu-tp2", 1, 2)], config)
    try:
        d.start(timeout_s=600)
        coord = replica(d, "gpu-tp2").coordinator
        health = ray.get(coord.health.remote())
        assert health["device"].startswith("cuda") and health["step_path"] == "compiled graph", health
        got = [s.tokens for s in run_all(coord, sc.prompts(), sc.NEW_TOKENS, prefix="gpu-tp2-")]
    finally:
        d.shutdown()
        if started:
            ray.shutdown()
    _near(got, sc.run("cpu", DET32))


@pytest.mark.parametrize("name", ["check_flash_vs_sdpa", "check_nccl", "check_backup_round_trip",
                                  "check_demo_cuda_vs_cpu"])
def test_doctor_check_passes_on_this_gpu(name):
    from hyrax.cluster import doctor

    check = getattr(doctor, name)(doctor.Machine.here())
    # skip: this machine lacks what it needs; warn: a greedy token differs between two kernels or
    # devices (a near-tie: how many agree is in the detail, and the engine tests bound it)
    assert check.status in (doctor.OK, doctor.SKIP, doctor.WARN), check
    print(check)
