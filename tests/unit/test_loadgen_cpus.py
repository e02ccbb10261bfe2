"""The serving benchmark's load generator stands in for remote clients: it keeps off the CPUs
the deployment's ranks claimed (bench/loadgen.py), which the job names."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROBE = """
import os, sys
from bench import loadgen

async def where(job):  # run in place of the load: the CPUs the clients would run on
    return sorted(os.sched_getaffinity(0))

sys.exit(loadgen.main(where))
"""


def _affinity_under(job: dict) -> list[int]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    out = subprocess.run([sys.executable, "-c", PROBE], input=json.dumps(job), capture_output=True, text=True,
                         cwd=ROOT, env=env, timeout=60)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs to keep one off")
def test_the_clients_keep_off_the_claimed_cpus():
    cpus = sorted(os.sched_getaffinity(0))
    assert _affinity_under({"keep_off_cpus": [cpus[-1]]}) == cpus[:-1]
    assert _affinity_under({"keep_off_cpus": []}) == cpus
    assert _affinity_under({}) == cpus  # jobs of other callers name none


def test_no_cpu_left_means_staying_where_it_is():
    cpus = sorted(os.sched_getaffinity(0))
    assert _affinity_under({"keep_off_cpus": cpus}) == cpus
