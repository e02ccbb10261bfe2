"""CPUs of their own for a machine's CPU ranks, and a coordinator step loop that keeps off them.

Why: measured on the 2-core VM (Ray TP=1, batch 32, overlap): when a rank rang its
coordinator's step bell at the end of a step, the kernel woke the coordinator's loop thread on
the rank's own CPU, and the rank, already on its next step, waited ~0.45 ms a step for it (the
ring's send took 0.48 ms of wall time for 0.04 ms of CPU; an eventfd doorbell did the same, so it
is where the wakee runs, not the kind of wake-up). With the rank on one CPU and the loop thread
on the other the ring took 0.05 ms and the overhead share of an overlapped step fell from
0.14-0.21 to 0.07-0.08.

How: a rank on the CPU claims as many CPUs as it runs torch threads (`claim`), each by an
exclusive `flock` on a per-CPU file, and pins every thread of its process to them; the locks
live as long as the process (a dead rank's claims go with it). The first CPU of the process's
set is never claimed, so that coordinators, the gateway and Ray always keep one. The lock files
live in one directory per temp directory and boot (`claims_dir`): processes that see different
temp directories (containers with their own /tmp) do not see each other's claims, so a process
whose CPU time is capped by a cgroup quota - a container sharing the machine's CPUs with others
rather than owning some - claims nothing. A coordinator's process, every thread of it, keeps off
the CPUs its own ranks on its machine claimed (`keep_off`, called by RayExecutor) and gets its
CPUs back when the executor closes; a gateway's process keeps off every CPU claimed on its
machine once its deployment is up and again when replicas are added (`hyrax serve`). Only the
stepping thread kept off at first; its process's other threads (Ray's, the feed's) and the
gateway's still ran on the rank's CPU when the other was busy: measured on the 2-core VM (quick
c=16 serving workload of 128 requests, 5 runs each, alternating, the load generator kept off
too), the full stack made 0.92 of the in-process engine's tok/s that way and 0.98-1.00 with both
processes kept off (every run faster). Where there are fewer CPUs to claim than ranks, a
disaggregated deployment's prefill ranks claim first (the note above rank.RankWorker says why).
Nothing here raises: a directory, lock file or cgroup file that cannot be used means no claim.
`--cpu-affinity off`: nothing is claimed or pinned.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

AFFINITY_MODES = ("auto", "off")


def claims_dir() -> Path:
    """Where the per-CPU lock files live: one directory per temp directory and boot (a temp
    directory shared by machines, over NFS, then holds one per machine)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        boot = "noboot"
    return Path(tempfile.gettempdir()) / f"hyrax-cpu-claims-{boot}"


def allowed_cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def cpu_quota() -> bool:
    """Whether this process's CPU time is capped by a cgroup quota (v2 `cpu.max`, v1
    `cpu.cfs_quota_us`): then it shares the machine's CPUs rather than owning some."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return False
    root = Path("/sys/fs/cgroup")
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        rel = path.lstrip("/")
        if controllers == "":  # v2
            candidates = [root / rel / "cpu.max", root / "cpu.max"]
        elif "cpu" in controllers.split(","):
            candidates = [root / d / rel / "cpu.cfs_quota_us" for d in (controllers, "cpu", "cpu,cpuacct")]
        else:
            continue
        for f in candidates:
            try:
                value = f.read_text().split()[0]
            except (OSError, IndexError):
                continue
            if value not in ("max", "-1"):
                return True
    return False


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
    this one) holds it, or the lock file cannot be used."""
    try:
        fd = os.open(where / f"cpu-{cpu}.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return fd
    except OSError:  # held (EWOULDBLOCK), or a file system without locks
        os.close(fd)
        return None


def _threads() -> list[int]:
    """The ids of this process's threads (raises OSError where /proc cannot say)."""
    return [int(t) for t in os.listdir("/proc/self/task")]


def thread_cpu_sets() -> set[tuple[int, ...]]:
    """The distinct CPU sets this process's threads may run on."""
    out = set()
    for tid in _threads():
        try:
            out.add(tuple(sorted(os.sched_getaffinity(tid))))
        except OSError:  # a thread that ended meanwhile
            pass
    return out


def _pin_every_thread(cpus: set[int], spare: int | None = None) -> bool:
    """Pin every thread of this process (but `spare`) to `cpus`; twice over, so that a thread
    started during the first pass by a thread not yet pinned is caught. False when a live thread
    could not be pinned."""
    for _ in range(2):
        try:
            tids = [tid for tid in _threads() if tid != spare]
        except OSError:
            return False
        for tid in tids:
            try:
                os.sched_setaffinity(tid, cpus)
            except OSError as e:
                if e.errno != errno.ESRCH:  # a thread that ended meanwhile is fine; anything else is not
                    return False
    return True


def claim(n: int, where: Path | None = None) -> CpuClaim | None:
    """Claim `n` CPUs this process may use, never the first of them, and pin every thread of the
    process to them. None (nothing claimed, nothing pinned) when fewer than `n` are free, under a
    cgroup CPU quota, or when anything on the way fails."""
    where = where or claims_dir()
    cpus = allowed_cpus()
    if n < 1 or len(cpus) < n + 1 or cpu_quota():
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
    claimed_now = CpuClaim(tuple(sorted(cpu for cpu, _ in got)), tuple(fd for _, fd in got))
    if len(got) < n or not _pin_every_thread(set(claimed_now.cpus)):
        claimed_now.release()
        _pin_every_thread(set(cpus))  # whatever was pinned goes back
        return None
    return claimed_now


def claimed(where: Path | None = None) -> set[int]:
    """The CPUs this process may use that some process has claimed (this one's own claims too);
    a lock file that cannot be used counts as not claimed."""
    where = where or claims_dir()
    out = set()
    for cpu in allowed_cpus():
        try:
            path = where / f"cpu-{cpu}.lock"
            if not path.exists() or not os.access(path, os.R_OK | os.W_OK):
                continue
        except OSError:  # a directory this process may not look into
            continue
        fd = _lock(where, cpu)
        if fd is None:
            out.add(cpu)
        else:
            os.close(fd)  # closing the fd drops the lock taken just now
    return out


def keep_off(cpus: set[int], spare: int | None = None) -> set[int] | None:
    """Pin every thread of this process (but the thread whose native id is `spare`) to the CPUs
    the calling thread may use other than `cpus`: a coordinator's or a gateway's threads keep
    off the CPUs ranks claimed. Threads they start later inherit it. Returns the CPUs the calling
    thread could use before (`restore` gives them back), or None when nothing changed (none of
    them to keep off, nothing else left, or a thread that could not be pinned: then every thread
    is back where it was)."""
    try:
        before = os.sched_getaffinity(0)
    except OSError as e:
        log.info("cpu claims: this process stays where it is (%s)", e)
        return None
    free = before - cpus
    if not free or free == before:
        return None
    if not _pin_every_thread(free, spare):
        _pin_every_thread(before, spare)
        log.info("cpu claims: a thread could not be pinned; this process stays where it is")
        return None
    log.info("cpu claims: this process runs on CPUs %s, off the ranks' %s", sorted(free), sorted(before & cpus))
    return before


def restore(cpus: set[int], spare: int | None = None) -> None:
    """Give every thread of this process (but `spare`) the CPUs `cpus` (what keep_off answered)."""
    _pin_every_thread(cpus, spare)
