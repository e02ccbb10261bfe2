"""A TP replica's collective group (torch.distributed store + gloo transport) listens on the
node's Ray address only — 127.0.0.1 for a local cluster — never on every interface."""
from __future__ import annotations

import ipaddress
import os

import ray

from ray_harness import call, replica


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def _hex_addr(field: str) -> ipaddress._BaseAddress:
    """The address of /proc/net/tcp{,6}'s `local_address` field (host byte order per 32-bit word)."""
    raw = bytes.fromhex(field)
    words = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    addr = ipaddress.ip_address(words)
    return getattr(addr, "ipv4_mapped", None) or addr


def listening_addresses(pid: int) -> list[tuple[str, int]]:
    """(address, port) of every TCP socket in LISTEN state that process `pid` holds."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:["):-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                    host, port = fields[1].split(":")
                    found.append((str(_hex_addr(host)), int(port, 16)))
    return found


def test_tp2_collective_group_listens_on_the_node_address_only(demo_deployment):
    node_ip = ray.util.get_node_ip_address()
    assert node_ip == "127.0.0.1"  # a local cluster keeps to loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)
    coord = replica(demo_deployment, "tp2").coordinator
    ranks = call(coord.rank_handles)
    assert len(ranks) == 2
    tp1_rank = call(replica(demo_deployment, "tp1").coordinator.rank_handles)[0]
    # a TP=1 rank has no group: what it listens on is Ray's own, the baseline to subtract
    baseline = len(listening_addresses(_pid(tp1_rank)))
    for k, rank in enumerate(ranks):
        socks = listening_addresses(_pid(rank))
        assert len(socks) > baseline, f"rank {k}: no collective socket found among {socks}"
        wrong = [s for s in socks if s[0] != node_ip]
        assert not wrong, f"rank {k} listens beyond {node_ip}: {wrong} (all: {socks})"
