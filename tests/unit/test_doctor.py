"""`hyrax doctor`: one line per check; without CUDA it names what it skipped and exits 0."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from hyrax.cluster import doctor
from hyrax.cluster.cli import main as cli_main
from hyrax.actors.model.paged_decode import available as cpu_paged_unavailable


@pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without CUDA")
def test_without_cuda_it_runs_what_it_can_skips_the_rest_and_exits_0(capsys):
    assert cli_main(["doctor", "--json"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    checks = {c["name"]: c for c in map(json.loads, lines)}
    assert list(checks) == ["versions", "attention backend", "cpu kernels", "flash vs sdpa", "nccl",
                            "backup round trip", "demo cuda vs cpu"]
    assert checks["versions"]["detail"].startswith("torch ")
    cpu_f32 = "cpu_paged" if cpu_paged_unavailable() is None else "sdpa"
    assert checks["attention backend"]["detail"].startswith(f"on cpu: bfloat16=sdpa, float16=sdpa, float32={cpu_f32}")
    if cpu_paged_unavailable() is None:
        assert checks["cpu kernels"]["status"] == "ok", checks["cpu kernels"]
        assert checks["cpu kernels"]["detail"].endswith("48/48 tokens through cpu_paged equal to sdpa")
        assert checks["cpu kernels"]["detail"].startswith("paged_decode, ssd_scan, causal_conv, mamba2_rows, state_rows, gemm_rows built")
    assert checks["backup round trip"]["status"] == "ok" and "checksums match" in checks["backup round trip"]["detail"]
    skipped = {n: c["detail"] for n, c in checks.items() if c["status"] == "skip"}
    assert skipped == {"flash vs sdpa": "no CUDA device", "nccl": "needs 2 GPUs, found 0",
                       "demo cuda vs cpu": "no CUDA device"}


def test_text_output_is_one_line_per_check(capsys):
    machine = doctor.Machine(cuda=False, gpus=0)
    assert doctor.main(argparse.Namespace(json=False), machine) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == len(doctor.CHECKS)
    assert lines[4] == "skip  nccl: needs 2 GPUs, found 0"


def test_a_check_that_raises_fails_alone_and_the_exit_status_says_so(monkeypatch, capsys):
    def check_broken(machine):
        raise RuntimeError("NCCL error: unhandled system error\nmore")

    monkeypatch.setattr(doctor, "CHECKS", (doctor.check_versions, check_broken, doctor.check_nccl))
    assert doctor.main(argparse.Namespace(json=False), doctor.Machine(cuda=False, gpus=0)) == 1
    out = capsys.readouterr().out.strip().splitlines()
    assert out[1] == "fail  broken: RuntimeError: NCCL error: unhandled system error"
    assert out[0].startswith("ok") and out[2].startswith("skip")


@pytest.mark.parametrize("cuda_tokens, status", [
    ([[1, 2, 3], [4, 5, 6]], "ok"),
    ([[1, 2, 3], [4, 9, 9]], "warn"),  # a near-tie flipped: the rest of that request follows it
    ([[7, 7, 7], [7, 7, 7]], "fail"),  # the device computes something else
], ids=["equal", "one request apart", "most apart"])
def test_demo_tokens_on_cuda_against_the_cpu_fail_when_most_differ(monkeypatch, cuda_tokens, status):
    """A warning is for rounding that flips a near-tie; tokens that mostly differ fail the check,
    so the GPU tests (which accept a warning) and the exit status catch a broken device path."""
    cpu_tokens = [[1, 2, 3], [4, 5, 6]]
    monkeypatch.setattr(doctor, "demo_greedy", lambda device, **config: cpu_tokens if device == "cpu" else cuda_tokens)
    check = doctor.check_demo_cuda_vs_cpu(doctor.Machine(cuda=True, gpus=1))
    assert check.status == status, check
