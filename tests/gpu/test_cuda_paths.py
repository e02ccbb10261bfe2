"""CUDA paths against the CPU reference (skipped without CUDA): the model's forward on the
GPU, and retraction with pinned, stream-synchronised host backups."""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import demo_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = (5, 40, 130, 77)


def _outputs(device: str, **kw) -> tuple[list[list[int]], dict]:
    return demo_greedy(device, LENGTHS, dtype="float32", **kw)


def test_cuda_greedy_outputs_match_the_cpu_engine():
    cpu, _ = _outputs("cpu")
    gpu, _ = _outputs("cuda")
    same = sum(a == b for a, b in zip(cpu, gpu))
    assert same >= len(LENGTHS) - 1, (cpu, gpu)  # TF32/kernel differences may flip one near-tie


@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool"])
def test_cuda_forced_retraction_restores_verified_and_outputs_unchanged(mode):
    base, _ = _outputs("cuda")
    out, stats = _outputs("cuda", forced_retraction_interval=3, retraction_backup=mode)
    assert out == base
    assert stats["restores_by"].get("verified", 0) > 0 and stats["restore_fallbacks"] == 0
