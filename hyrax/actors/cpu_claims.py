"""CPUs of their own for a node's CPU ranks, and a coordinator step loop that keeps off them.

Why: measured on the 2-core VM (Ray TP=1, batch 32, overlap): when a rank rang its
coordinator's step bell at the end of a step, the kernel woke the coordinator's loop thread on
the rank's own CPU, and the rank, already on its next step, waited ~0.45 ms a step for it (the
ring's send took 0.48 ms of wall time for 0.04 ms of CPU; an eventfd doorbell did the same, so it
is where the wakee runs, not the kind of wake-up). With the rank on one CPU and the loop thread
on the other the ring took 0.05 ms and the overhead share of an overlapped step fell from 0.16
to 0.08.

How: a rank on the CPU claims as many CPUs as it runs torch threads (`claim`), each by an
exclusive `flock` on a per-CPU file under the machine's temp directory, and pins every thread of
its process to them; the locks live as long as the process (a dead rank's claims go with it).
The first CPU the process may use is never claimed, so that the coordinators, the gateway and
Ray always keep one. The coordinator's loop thread pins itself to the CPUs no rank claimed
(`keep_off_claimed`) when it builds a replica's compiled graph (its ranks are set up by then),
and gets its old CPUs back when the graph is closed. Where too few CPUs are free, or
`--cpu-affinity off`, everything runs where the OS puts it, as before.
"""
from __future__ import annotations

import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

AFFINITY_MODES = ("auto", "off")


def claims_dir() -> Path:
    """Where the per-CPU lock files live (one directory per machine, whoever claims)."""
    return Path(tempfile.gettempdir()) / "hyrax-cpu-claims"


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@dataclass
class CpuClaim:
    cpus: tuple[int, ...]
    fds: tuple[int, ...]  # open while the claim lasts

    def release(self) -> None:
        for fd in self.fds:
            os.close(fd)
        self.fds = ()


def _lock(where: Path, cpu: int) -> int | None:
    """An fd holding `cpu`'s exclusive lock, or None when another process (or another claim of
    this one) holds it, or the lock file cannot be opened (another user's directory: then this
    process neither claims nor sees claims there)."""
    try:
        fd = os.open(where / f"cpu-{cpu}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except BlockingIOError:
        os.close(fd)
        return None


def claim(n: int, where: Path | None = None) -> CpuClaim | None:
    """Claim `n` CPUs this process may use, never the first of them, and pin every thread of the
    process to them. None (and nothing pinned) when fewer than `n` are free."""
    where = where or claims_dir()
    cpus = allowed_cpus()
    if n < 1 or len(cpus) < n + 1:
        return None
    try:
        where.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        log.info("cpu claims: no claims directory %s (%s); this rank runs where the OS puts it", where, e)
        return None
    got: list[tuple[int, int]] = []
    for cpu in cpus[1:]:
        fd = _lock(where, cpu)
        if fd is not None:
            got.append((cpu, fd))
            if len(got) == n:
                break
    if len(got) < n:
        for _, fd in got:
            os.close(fd)
        return None
    mine = {cpu for cpu, _ in got}
    for tid in os.listdir("/proc/self/task"):  # threads made later inherit their maker's CPUs
        try:
            os.sched_setaffinity(int(tid), mine)
        except OSError:  # a thread that ended meanwhile
            pass
    return CpuClaim(tuple(sorted(mine)), tuple(fd for _, fd in got))


def claimed(where: Path | None = None) -> set[int]:
    """The CPUs this process may use that some process has claimed (this one's own claims too)."""
    where = where or claims_dir()
    out = set()
    for cpu in allowed_cpus():
        path = where / f"cpu-{cpu}.lock"
        if not path.exists() or not os.access(path, os.R_OK | os.W_OK):
            continue  # never claimed, or another user's: not this process's business
        fd = _lock(where, cpu)
        if fd is None:
            out.add(cpu)
        else:
            os.close(fd)  # closing the fd drops the lock taken just now
    return out


def keep_off_claimed(where: Path | None = None) -> set[int] | None:
    """Pin the calling thread to the CPUs no process claimed; returns the CPUs it could use
    before (to restore), or None when nothing changed (no claims, or every CPU claimed)."""
    before = os.sched_getaffinity(0)
    free = before - claimed(where)
    if not free or free == before:
        return None
    os.sched_setaffinity(0, free)
    log.info("step loop: on CPUs %s, off the ranks' %s", sorted(free), sorted(before - free))
    return before
