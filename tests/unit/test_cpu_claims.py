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


def test_the_step_loop_thread_keeps_off_given_cpus_alone_and_gets_them_back():
    seen = {}

    def loop_thread():
        seen["tid"] = threading.get_native_id()
        seen["before"] = cpu_claims.keep_off({CPUS[1]})
        seen["on"] = os.sched_getaffinity(0)
        seen["nothing"] = cpu_claims.keep_off(set(CPUS))  # nothing else left: stays
        cpu_claims.restore(seen["tid"], seen["before"])
        seen["back"] = os.sched_getaffinity(0)

    t = threading.Thread(target=loop_thread)
    t.start()
    t.join()
    assert seen["before"] == set(CPUS)
    assert seen["on"] == set(CPUS) - {CPUS[1]}
    assert seen["nothing"] is None
    assert seen["back"] == set(CPUS)
    assert os.sched_getaffinity(0) == set(CPUS)  # only the calling thread moved
    assert cpu_claims.keep_off(set()) is None


def test_restore_leaves_alone_a_thread_id_that_is_not_this_processs(monkeypatch):
    """The pinned thread may have ended before the executor closes, and its id may already name
    another thread of any process: only a thread of this process gets CPUs back."""
    calls = []
    monkeypatch.setattr(cpu_claims.os, "sched_setaffinity", lambda tid, cpus: calls.append(tid))
    cpu_claims.restore(2**22 + 12345, {CPUS[0]})  # beyond pid_max's default: no thread of this process
    assert calls == []
    me = threading.get_native_id()
    cpu_claims.restore(me, {CPUS[0]})
    assert calls == [me]


def test_a_cgroup_cpu_quota_means_no_claim(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_claims, "cpu_quota", lambda: True)
    assert cpu_claims.claim(1, tmp_path) is None
    assert cpu_claims.claimed(tmp_path) == set()


def test_cpu_quota_reads_cgroup_v1_and_v2(tmp_path, monkeypatch):
    real = cpu_claims.Path

    def fake_root(quota_v2: str | None, quota_v1: str | None):
        root = tmp_path / "cg"
        (root / "cpu").mkdir(parents=True, exist_ok=True)
        for f, v in ((root / "cpu.max", quota_v2), (root / "cpu" / "cpu.cfs_quota_us", quota_v1)):
            if v is None:
                f.unlink(missing_ok=True)
            else:
                f.write_text(v)
        return root

    def run(cgroup: str, root: Path) -> bool:
        (tmp_path / "self-cgroup").write_text(cgroup)

        def path(p, *rest):
            p = str(p)
            if p == "/proc/self/cgroup":
                return real(tmp_path / "self-cgroup")
            if p == "/sys/fs/cgroup":
                return real(root)
            return real(p, *rest)
        monkeypatch.setattr(cpu_claims, "Path", path)
        try:
            return cpu_claims.cpu_quota()
        finally:
            monkeypatch.setattr(cpu_claims, "Path", real)

    assert run("0::/\n", fake_root("max 100000", None)) is False
    assert run("0::/\n", fake_root("200000 100000", None)) is True
    assert run("3:cpuset:/\n1:cpu:/\n", fake_root(None, "-1")) is False
    assert run("3:cpuset:/\n1:cpu:/\n", fake_root(None, "150000")) is True


def test_a_claims_directory_this_process_may_not_read_means_no_claims_seen(tmp_path, monkeypatch):
    real_exists = cpu_claims.Path.exists

    def exists(self):
        if "claims" in str(self):
            raise PermissionError(13, "Permission denied", str(self))
        return real_exists(self)
    monkeypatch.setattr(cpu_claims.Path, "exists", exists)
    assert cpu_claims.claimed(tmp_path / "claims") == set()


def test_a_claims_directory_that_cannot_be_used_means_no_claims_not_an_error(tmp_path):
    blocked = tmp_path / "file-not-dir"
    blocked.write_text("")  # a file where the directory should be: mkdir and open fail
    assert cpu_claims.claim(1, blocked / "claims") is None
    assert cpu_claims.claimed(blocked / "claims") == set()
    assert os.sched_getaffinity(0) == set(CPUS)
