"""RankWorker: the Ray actor of one tensor-parallel rank.

A thin shell over `RankRuntime`: it loads its weight shard, joins its replica's
torch.distributed group (gloo on CPU, NCCL on GPU) for row-parallel all-reduces, and holds
its shard of every pool. It decides nothing.
"""
from __future__ import annotations

import socket

import ray
import torch

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.pools import host_pool_rows, pool_sizes
from hyrax.actors.engine.rank_runtime import RankRuntime
from hyrax.actors.model.hybrid import DTYPES
from hyrax.actors.model.loader import load_model
from hyrax.actors.model.sharding import TP
from hyrax.env import apply_torch_threads


@ray.remote(num_cpus=1, max_restarts=0)  # one call at a time: steps run in submission order
class RankWorker:
    def __init__(self, role: str, replica: int, tp_rank: int, tp_size: int):
        apply_torch_threads()
        self.role, self.replica = role, replica
        self.tp = TP(tp_rank, tp_size)
        self.runtime: RankRuntime | None = None
        self.device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

    def dist_address(self) -> str:
        """Rank 0 picks where the replica's process group meets: this node, a free port."""
        ip = ray.util.get_node_ip_address()
        with socket.socket() as s:
            s.bind((ip, 0))
            return f"{ip}:{s.getsockname()[1]}"

    def setup(self, model_dir: str, config: EngineConfig, dist_address: str | None) -> dict:
        allreduce, broadcast = _identity, None
        if self.tp.size > 1:
            import torch.distributed as dist

            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{dist_address}",
                                    rank=self.tp.rank, world_size=self.tp.size)
            allreduce, broadcast = _dist_allreduce, _dist_broadcast_tokens
        model = load_model(model_dir, self.tp, DTYPES[config.dtype], allreduce, self.device, config.attention_backend)
        comps = model.components
        sizes = pool_sizes(comps, config.page_size, config.kv_capacity_tokens, config.mamba_slots,
                           config.swa_capacity_tokens)
        host = host_pool_rows(comps, sizes, config.host_pool_mb)
        self.runtime = RankRuntime(model, sizes, host, self.tp.rank, config.faults, self.device, broadcast)
        return {"rank": self.tp.rank, "device": str(self.device), "attention_backend": model.attention_backend_name,
                "pool_bytes": {n: t.numel() * t.element_size() for n, t in self.runtime.pools.items()}}

    def ping(self) -> int:
        return self.tp.rank

    def execute(self, plan):
        return self.runtime.execute(plan)

    def backup(self, req_id, rows, host_rows):
        return self.runtime.backup(req_id, rows, host_rows)

    def restore(self, req_id, rows, host_rows):
        return self.runtime.restore(req_id, rows, host_rows)

    def export(self, req_id, rows):
        return self.runtime.export(req_id, rows)

    def import_state(self, req_id, rows, expect, *shards):
        return self.runtime.import_state(req_id, rows, expect, *shards)

    def discard(self, req_id):
        self.runtime.discard(req_id)

    def num_backups(self) -> int:
        return self.runtime.num_backups()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


def _dist_broadcast_tokens(tokens: list[int]) -> list[int]:
    """Rank 0's sampled tokens, on every rank (they feed the next step's placeholders)."""
    import torch.distributed as dist

    t = torch.tensor(tokens, dtype=torch.long)
    dist.broadcast(t, src=0)
    return t.tolist()


def _dist_allreduce(t: torch.Tensor) -> torch.Tensor:
    import torch.distributed as dist

    dist.all_reduce(t)
    return t
