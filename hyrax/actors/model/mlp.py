"""Feed-forward blocks, column-parallel in, row-parallel out: each rank holds a contiguous
slice of the intermediate dimension and the caller (or `allreduce`) sums the ranks.

- `GatedMLP`: down(silu(gate(x)) * up(x)) with separate gate/up projections (Bamba, Qwen);
  Falcon-H1 scales gate(x) before the activation and the output by its mlp_multipliers.
- `FusedGatedMLP`: the same with gate and up stacked in one `input_linear` (Granite).
- `ReluSqMLP`: down(relu(up(x))^2) (NemotronH).
"""
from __future__ import annotations

import torch
from torch import nn

from hyrax.actors.model import sharding
from hyrax.actors.model.norm import AllReduce, identity_allreduce
from hyrax.actors.model.sharding import TP


def relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(nn.functional.relu(x))


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TP, dtype: torch.dtype,
                 allreduce: AllReduce = identity_allreduce, bias: bool = False,
                 gate_multiplier: float = 1.0, down_multiplier: float = 1.0):
        super().__init__()
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier
        self.cols = list(sharding.columns(intermediate, tp, "intermediate_size"))
        n = len(self.cols)
        self.gate_proj = nn.Linear(hidden, n, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(hidden, n, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(n, hidden, bias=bias and tp.rank == 0, dtype=dtype)
        self.allreduce = allreduce

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        return {
            "gate_proj.weight": (0, self.cols), "gate_proj.bias": (0, self.cols),
            "up_proj.weight": (0, self.cols), "up_proj.bias": (0, self.cols),
            "down_proj.weight": (1, self.cols),
        }

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., hidden) -> (..., hidden), summed over TP ranks by `allreduce`."""
        g = self.gate_proj(x)
        if self.gate_multiplier != 1.0:
            g = g * self.gate_multiplier
        out = self.allreduce(self.down_proj(nn.functional.silu(g) * self.up_proj(x)))
        return out * self.down_multiplier if self.down_multiplier != 1.0 else out


class ReluSqMLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int, tp: TP, dtype: torch.dtype,
                 allreduce: AllReduce = identity_allreduce, bias: bool = False):
        super().__init__()
        self.cols = list(sharding.columns(intermediate, tp, "intermediate_size"))
        self.up_proj = nn.Linear(hidden, len(self.cols), bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(len(self.cols), hidden, bias=bias and tp.rank == 0, dtype=dtype)
        self.allreduce = allreduce

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        return {"up_proj.weight": (0, self.cols), "up_proj.bias": (0, self.cols), "down_proj.weight": (1, self.cols)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., hidden) -> (..., hidden)."""
        return self.allreduce(self.down_proj(relu2(self.up_proj(x))))


class FusedGatedMLP(nn.Module):
    """`input_linear` rows are [gate (intermediate) | up (intermediate)]."""

    def __init__(self, hidden: int, intermediate: int, tp: TP, dtype: torch.dtype,
                 allreduce: AllReduce = identity_allreduce):
        super().__init__()
        self.cols = list(sharding.columns(intermediate, tp, "shared_intermediate_size"))
        self.rows = self.cols + [intermediate + c for c in self.cols]
        self.input_linear = nn.Linear(hidden, len(self.rows), bias=False, dtype=dtype)
        self.output_linear = nn.Linear(len(self.cols), hidden, bias=False, dtype=dtype)
        self.allreduce = allreduce

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        return {"input_linear.weight": (0, self.rows), "output_linear.weight": (1, self.cols)}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., hidden) -> (..., hidden)."""
        gate, up = self.input_linear(x).chunk(2, dim=-1)
        return self.allreduce(self.output_linear(nn.functional.silu(gate) * up))
