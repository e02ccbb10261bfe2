"""A gateway's watch on the Ray cluster it runs on: it notices when the cluster is gone.

Ray starts a local cluster's GCS and raylet bound to the process that started it: when that
`hyrax serve` dies (SIGKILL, its terminal closed), they die with it, and so does every actor on
the node. A gateway attached to that cluster (`hyrax serve --address ADDR --attach`) then has
nothing left to serve, but nothing in it says so: a Ray call waits for the GCS, and Ray's core
worker retries the GCS for `gcs_rpc_server_reconnect_timeout_s` (60 s by default) before it
ends the process with a fatal Ray error.

`ClusterWatch` asks no Ray call (one would wait on the GCS it is asking about): it connects to
the GCS and to this node's raylet over TCP every `interval_s`, and once neither accepted a
connection for `rounds` rounds in a row it calls `on_lost(why)`, once. A GCS that restarts
(Ray's GCS fault tolerance) is no loss: the raylets stay up and wait for it, and so does the
gateway, whose replicas keep serving meanwhile.
"""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class ClusterEndpoints:
    """Where a driver reaches its cluster: the GCS, and the raylet of its own node (None when
    Ray did not say)."""
    gcs: str  # host:port
    raylet: str | None  # host:port


def accepts(address: str, timeout_s: float = 1.0) -> bool:
    """Whether something accepts a TCP connection at `address` (host:port) within `timeout_s`."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s).close()
        return True
    except (OSError, ValueError):
        return False


class ClusterWatch:
    def __init__(self, endpoints: ClusterEndpoints, on_lost: Callable[[str], None], interval_s: float = 0.5,
                 rounds: int = 3):
        self.endpoints, self.on_lost = endpoints, on_lost
        self.interval_s, self.rounds = interval_s, rounds

    def answering(self) -> bool:
        """Whether the cluster still answers here: its GCS, or this node's raylet."""
        e = self.endpoints
        return accepts(e.gcs) or (e.raylet is not None and accepts(e.raylet))

    def why(self) -> str:
        return (f"the Ray cluster at {self.endpoints.gcs} stopped answering (its GCS and this node's raylet are gone: "
                f"the process that started it ended, or the cluster was stopped); this gateway stops")

    async def run(self) -> None:
        """Probe until the cluster is gone, then tell `on_lost` and end."""
        missed = 0
        while missed < self.rounds:
            await asyncio.sleep(self.interval_s)
            missed = 0 if await asyncio.to_thread(self.answering) else missed + 1
        self.on_lost(self.why())
