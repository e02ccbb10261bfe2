"""CPU claims (hyrax/actors/cpu_claims.py): a rank process claims CPUs of its own, never the
first one, by locks that die with it; the step loop's thread keeps off the claimed CPUs. Claims
run in child processes (a claim pins every thread of its process) against a private claims
directory."""
from __future__ import annotations

import json
import os
import subprocess
import sys
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


KEEP_OFF = """
import json, os, sys, threading, time
from hyrax.actors import cpu_claims

def sets():
    return sorted({tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")})

off = set(json.loads(sys.argv[1]))
hold = threading.Event()
earlier = threading.Thread(target=hold.wait, daemon=True); earlier.start()  # made before: Ray's, the feed's
spare = {}
def spared():
    spare["tid"] = threading.get_native_id()
    spare["ready"].set(); hold.wait()
spare["ready"] = threading.Event()
threading.Thread(target=spared, daemon=True).start(); spare["ready"].wait()
before = cpu_claims.keep_off(off, spare=spare["tid"])
later = {}
t = threading.Thread(target=lambda: later.update(cpus=sorted(os.sched_getaffinity(0)))); t.start(); t.join()
out = {"before": sorted(before) if before is not None else None, "kept": sets(),
       "spare": sorted(os.sched_getaffinity(spare["tid"])), "later": later["cpus"],
       "nothing_left": cpu_claims.keep_off(set(range(4096)))}
if before is not None:
    cpu_claims.restore(before, spare=spare["tid"])
out["back"] = sets()
print(json.dumps(out))
"""


def _keep_off_in_child(cpus: set[int]) -> dict:
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2]))
    p = subprocess.run([sys.executable, "-c", KEEP_OFF, json.dumps(sorted(cpus))], capture_output=True, text=True,
                       env=env, timeout=60)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def test_a_process_keeps_off_given_cpus_every_thread_but_the_spared_one_and_gets_them_back():
    """A coordinator's or gateway's process: every thread, those made before and after, but the
    one spared (the bench's baselines' thread), runs off the CPUs given and gets them back."""
    r = _keep_off_in_child({CPUS[1]})
    rest = [c for c in CPUS if c != CPUS[1]]
    assert r["before"] == CPUS
    assert r["kept"] == [CPUS, rest] or r["kept"] == [rest, CPUS], r  # the spared thread alone keeps both
    assert r["spare"] == CPUS and r["later"] == rest
    assert r["nothing_left"] is None  # nothing else left: it stays
    assert r["back"] == [CPUS]


def test_keeping_off_no_claimed_cpu_changes_nothing():
    r = _keep_off_in_child(set())
    assert r["before"] is None and r["kept"] == [CPUS] and r["back"] == [CPUS]


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
