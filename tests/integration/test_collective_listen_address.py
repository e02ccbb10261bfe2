"""A TP replica's collective group (torch.distributed store + gloo transport) listens on the
node's Ray address only — 127.0.0.1 for a local cluster — never on every interface."""
from __future__ import annotations

import os

import ray

from listen_harness import listening
from ray_harness import call, replica


def _pid(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda self: os.getpid()), timeout=60)


def test_tp2_collective_group_listens_on_the_node_address_only(demo_deployment):
    node_ip = ray.util.get_node_ip_address()
    assert node_ip == "127.0.0.1"  # a local cluster keeps to loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0)
    coord = replica(demo_deployment, "tp2").coordinator
    ranks = call(coord.rank_handles)
    assert len(ranks) == 2
    tp1_rank = call(replica(demo_deployment, "tp1").coordinator.rank_handles)[0]
    # a TP=1 rank has no group: what it listens on is Ray's own, the baseline to subtract
    baseline = len(listening([_pid(tp1_rank)]))
    for k, rank in enumerate(ranks):
        socks = [(host, port) for _, host, port in listening([_pid(rank)])]
        assert len(socks) > baseline, f"rank {k}: no collective socket found among {socks}"
        wrong = [s for s in socks if s[0] != node_ip]
        assert not wrong, f"rank {k} listens beyond {node_ip}: {wrong} (all: {socks})"
