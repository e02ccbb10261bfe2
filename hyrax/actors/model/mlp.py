"""Gated (SwiGLU) MLP: column-parallel gate/up, row-parallel down."""
from __future__ import annotations

import torch
from torch import nn

from hyrax.actors.model import sharding
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.norm import AllReduce
from hyrax.actors.model.sharding import TP


class GatedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP, dtype: torch.dtype, allreduce: AllReduce):
        super().__init__()
        cols = sharding.mlp_columns(cfg, tp)
        self.cols = list(cols)
        n, h = len(cols), cfg.hidden_size
        self.gate_proj = nn.Linear(h, n, bias=cfg.mlp_bias, dtype=dtype)
        self.up_proj = nn.Linear(h, n, bias=cfg.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(n, h, bias=cfg.mlp_bias and tp.rank == 0, dtype=dtype)
        self.allreduce = allreduce

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        return {
            "gate_proj.weight": (0, self.cols), "gate_proj.bias": (0, self.cols),
            "up_proj.weight": (0, self.cols), "up_proj.bias": (0, self.cols),
            "down_proj.weight": (1, self.cols),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, hidden) -> (B, T, hidden), summed over TP ranks."""
        h = nn.functional.silu(self.gate_proj(x)) * self.up_proj(x)
        return self.allreduce(self.down_proj(h))
