"""Which TCP addresses processes listen on, read from /proc (Linux): the network-exposure
checks of the integration and e2e tests (nothing of a local deployment on 0.0.0.0 or ::)."""
from __future__ import annotations

import ipaddress
import os


def _address(field: str) -> str:
    """The address of a /proc/net/tcp{,6} `local_address` field (each 32-bit word in host order);
    an IPv4-mapped IPv6 address is reported as its IPv4 address."""
    raw = bytes.fromhex(field)
    addr = ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))
    return str(getattr(addr, "ipv4_mapped", None) or addr)


def _listening_inodes() -> dict[str, tuple[str, int]]:
    found = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A":  # LISTEN
                    host, port = fields[1].split(":")
                    found[fields[9]] = (_address(host), int(port, 16))
    return found


def listening(pids) -> list[tuple[int, str, int]]:
    """(pid, address, port) of every TCP socket in LISTEN state that one of `pids` holds."""
    table = _listening_inodes()
    out = []
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:  # exited meanwhile
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            inode = target[len("socket:["):-1] if target.startswith("socket:[") else None
            if inode in table:
                out.append((pid, *table[inode]))
    return out


def session_pids(sid: int) -> list[int]:
    """Every live process of session `sid` (a server started with start_new_session=True, and
    everything it started: Ray's daemons and workers)."""
    pids = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    pids.append(int(name))
            except OSError:
                continue
    return pids
