"""Native CPU kernels: C sources in `kernels/`, compiled on first use with the machine's C
compiler and called through ctypes on tensors' memory.

Why C and not torch operations: some CPU steps are a handful of tiny operations per request
whose cost is the dispatch and the copies between them, not the arithmetic. Decode attention
over the paged pool is the case in point (paged_decode.c): as torch operations it gathers
every row's keys into a padded copy, zeroes the padding, and runs batched products over it;
the kernel reads each key and value row once where it lies.

How: the source is compiled once per machine with `-O3 -march=native` into a cache directory
(`HYRAX_KERNEL_CACHE`, else `$XDG_CACHE_HOME/hyrax/kernels`, else `~/.cache/hyrax/kernels`;
a directory under the system's temporary directory where that one is not writable),
named by a hash of the source (and the headers beside it), the flags, the compiler's version
and the CPU's model and feature flags, so a machine with another CPU (a VM moved to another
host) builds its own. A build writes a temporary file and renames it, so processes building at
once never load a half-written library. Loading marks a library used (its modification time);
a new build deletes the same kernel's libraries unused for PRUNE_AFTER_S. No torch headers are
involved: a build takes well under a second.

Where there is no compiler, or the build fails, `load` answers why, and the callers keep
their torch paths (the attention backend says so once in the log).
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import torch

SOURCES = Path(__file__).parent / "kernels"
FLAGS = ("-O3", "-march=native", "-std=gnu99", "-fPIC", "-shared")
BUILD_TIMEOUT_S = 120.0


class NativeUnavailable(RuntimeError):
    """A kernel could not be built or loaded here; the message says why."""


def cache_dir() -> Path:
    if os.environ.get("HYRAX_KERNEL_CACHE"):
        return Path(os.environ["HYRAX_KERNEL_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hyrax" / "kernels"


def compiler() -> str | None:
    """The C compiler: $CC, else cc or gcc on PATH."""
    cc = os.environ.get("CC")
    if cc:
        return shutil.which(cc) or cc
    return shutil.which("cc") or shutil.which("gcc")


def _cpu_identity() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    lines = []
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("model name", "flags", "Features", "CPU part")) and line not in lines:
                    lines.append(line)
                if len(lines) >= 2 and not line.strip():
                    break
    except OSError:
        pass
    return platform.machine() + "".join(lines)


def _version(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"the C compiler {cc!r} does not run: {e}") from e


@functools.lru_cache(maxsize=None)
def load(name: str) -> ctypes.CDLL:
    """The library built from kernels/`name`.c (built now if this machine has not yet).
    Raises NativeUnavailable with the reason."""
    source = SOURCES / f"{name}.c"
    code = source.read_bytes()
    cc = compiler()
    if cc is None:
        raise NativeUnavailable("no C compiler (cc, gcc or $CC) is on PATH")
    headers = [h.read_bytes() for h in sorted(SOURCES.glob("*.h"))]  # what a source may include
    key = hashlib.sha256(b"\0".join([code, *headers, " ".join(FLAGS).encode(), _version(cc).encode(),
                                     _cpu_identity().encode()])).hexdigest()[:20]
    places = [d / f"{name}-{key}.so" for d in (cache_dir(), _fallback_dir())]
    lib = next((p for p in places if p.exists() and _ours(p.parent)), None)
    if lib is not None:
        _mark_used(lib)
    else:
        lib, unwritable = None, []
        for place in places:
            try:
                tmp = _temp_file(place)
            except OSError as e:  # a read-only home (some containers): the next place
                unwritable.append(f"{str(place.parent)!r}: {e}")
                continue
            _build(cc, source, tmp, place)
            lib = place
            _prune(place.parent, name, keep=place)
            break
        if lib is None:
            raise NativeUnavailable("no writable place for the kernel: " + "; ".join(unwritable))
    try:
        return ctypes.CDLL(str(lib))
    except OSError as e:
        raise NativeUnavailable(f"{lib.name} does not load: {e}") from e


# A build is kept while some process loads it: a library none has loaded for this long is
# deleted when a new build of the same kernel lands beside it (an older source, compiler or
# CPU; a cache shared by hosts keeps every build in use on any of them).
PRUNE_AFTER_S = 30 * 24 * 3600


def _mark_used(lib: Path) -> None:
    """Record that `lib` is in use (its modification time: once per process and kernel)."""
    try:
        os.utime(lib)
    except OSError:  # a read-only cache still serves; it is only never pruned
        pass


def _prune(directory: Path, name: str, keep: Path) -> None:
    """Delete the builds of kernel `name` in `directory`, other than `keep`, that no process
    has loaded for PRUNE_AFTER_S (unlinking a library a process has loaded leaves its mapping)."""
    cutoff = time.time() - PRUNE_AFTER_S
    for old in directory.glob(f"{name}-*.so"):
        try:
            if old != keep and old.stat().st_mtime < cutoff:
                old.unlink()
        except OSError:  # another process pruned it first, or it is not ours to delete
            pass


def function(name: str, symbol: str, argtypes: list, restype=ctypes.c_int):
    """`symbol` of the library built from kernels/`name`.c, with its C signature declared;
    raises NativeUnavailable."""
    fn = getattr(load(name), symbol)
    if fn.argtypes is None:
        fn.argtypes, fn.restype = argtypes, restype
    return fn


def unavailable(name: str) -> str | None:
    """None when kernels/`name`.c builds and loads here, else why not."""
    try:
        load(name)
    except NativeUnavailable as e:
        return str(e)
    return None


# the return codes of the kernels that update pool rows in place (ssd_scan.c, causal_conv.c,
# mamba2_rows.c); each checks its rows before it writes anything
SHARED_ROW = -4
ROW_KERNEL_ERRORS = {-1: "a state row lies outside the pool", -3: "no memory for the kernel's scratch",
                     SHARED_ROW: "two sequences of a step share a state row"}


def raise_for(rc: int, what: str, errors: dict[int, str]) -> None:
    """A kernel's nonzero return code as the error it stands for (`errors`: code -> message): a
    ValueError for rows the caller gave twice, else a RuntimeError."""
    if rc:
        raise (ValueError if rc == SHARED_ROW else RuntimeError)(f"{what}: {errors.get(rc, f'error {rc}')}")


def _fallback_dir() -> Path:
    return Path(tempfile.gettempdir()) / f"hyrax-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _ours(directory: Path) -> bool:
    """Whether only this user can put files in `directory` (a library is loaded from it: never
    from a directory someone else made, e.g. under a shared /tmp)."""
    try:
        st = os.stat(directory)
    except OSError:
        return False
    return (not hasattr(os, "getuid") or st.st_uid == os.getuid()) and not st.st_mode & 0o022


def _temp_file(lib: Path) -> str:
    lib.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    if not _ours(lib.parent):
        raise PermissionError(f"{str(lib.parent)!r} is not this user's alone")
    fd, tmp = tempfile.mkstemp(prefix=lib.stem, suffix=".tmp", dir=lib.parent)
    os.close(fd)
    return tmp


def _build(cc: str, source: Path, tmp: str, lib: Path) -> None:
    """Compile into `tmp`, then rename it to `lib` (a library appears whole or not at all)."""
    try:
        done = subprocess.run([cc, *FLAGS, "-o", tmp, str(source), "-lm"], capture_output=True, text=True,
                              timeout=BUILD_TIMEOUT_S)
        if done.returncode != 0:
            raise NativeUnavailable(f"{cc} could not build {source.name}: {done.stderr.strip()[-500:]}")
        os.replace(tmp, lib)
    except (OSError, subprocess.SubprocessError) as e:
        raise NativeUnavailable(f"{cc} could not build {source.name}: {e}") from e
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
