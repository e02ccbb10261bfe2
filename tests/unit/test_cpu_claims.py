"""CPU claims (hyrax/actors/cpu_claims.py): a rank process claims CPUs of its own, never the
first one, by locks that die with it; the step loop's thread keeps off the claimed CPUs. Claims
run in child processes (a claim pins every thread of its process) against a private claims
directory."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from hyrax.actors import cpu_claims

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs 2 CPUs")

CHILD = """
import os, sys, threading, time
from pathlib import Path
from hyrax.actors import cpu_claims
t = threading.Thread(target=time.sleep, args=(60,), daemon=True); t.start()  # a thread made before the claim
c = cpu_claims.claim(int(sys.argv[2]), Path(sys.argv[1]))
threads = {int(tid): sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")}
print(None if c is None else list(c.cpus), sorted(set(map(tuple, threads.values()))), flush=True)
sys.stdin.read()  # hold the claim until the test closes stdin
"""


def _claimer(where: Path, n: int = 1) -> tuple[subprocess.Popen, str]:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.Popen([sys.executable, "-c", CHILD, str(where), str(n)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True, env=env)
    return p, p.stdout.readline().strip()


def _end(p: subprocess.Popen) -> None:
    p.stdin.close()
    p.wait(timeout=30)


def test_a_claim_takes_cpus_of_its_own_never_the_first_and_pins_every_thread(tmp_path):
    p, line = _claimer(tmp_path)
    try:
        assert line == f"[{CPUS[1]}] [({CPUS[1]},)]", line  # the thread made before the claim too
        assert cpu_claims.claimed(tmp_path) == {CPUS[1]}
    finally:
        _end(p)


def test_claims_exclude_each_other_leave_the_first_cpu_and_die_with_their_process(tmp_path):
    many = len(CPUS) - 1  # every CPU but the first
    p, line = _claimer(tmp_path, many)
    try:
        assert line.startswith(str(CPUS[1:])), line
        q, other = _claimer(tmp_path)
        _end(q)
        assert other.startswith("None"), other  # nothing left: it runs where the OS puts it
        assert CPUS[0] not in cpu_claims.claimed(tmp_path)
    finally:
        _end(p)
    assert cpu_claims.claimed(tmp_path) == set()  # its locks went with it
    q, again = _claimer(tmp_path)
    _end(q)
    assert again.startswith(f"[{CPUS[1]}]"), again


def test_asking_for_every_cpu_claims_none(tmp_path):
    p, line = _claimer(tmp_path, len(CPUS))
    _end(p)
    assert line.startswith("None"), line
    assert cpu_claims.claimed(tmp_path) == set()


def test_the_step_loop_thread_keeps_off_claimed_cpus_and_alone(tmp_path):
    p, _ = _claimer(tmp_path)
    seen = {}

    def loop_thread():
        seen["before"] = cpu_claims.keep_off_claimed(tmp_path)
        seen["on"] = os.sched_getaffinity(0)
        os.sched_setaffinity(0, seen["before"])

    try:
        t = threading.Thread(target=loop_thread)
        t.start()
        t.join()
        assert seen["before"] == set(CPUS)
        assert seen["on"] == set(CPUS) - {CPUS[1]}
        assert os.sched_getaffinity(0) == set(CPUS)  # only the calling thread moved
    finally:
        _end(p)
    assert cpu_claims.keep_off_claimed(tmp_path) is None  # no claims: nothing to keep off
    assert os.sched_getaffinity(0) == set(CPUS)


def test_a_claims_directory_that_cannot_be_used_means_no_claims_not_an_error(tmp_path):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")  # a file where the directory should be: mkdir and open fail
    assert cpu_claims.claim(1, blocked / "claims") is None
    assert cpu_claims.claimed(blocked / "claims") == set()
    assert cpu_claims.keep_off_claimed(blocked / "claims") is None
    assert os.sched_getaffinity(0) == set(CPUS)
