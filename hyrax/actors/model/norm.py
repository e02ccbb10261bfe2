"""RMSNorm and the gated, group-wise RMSNorm of Mamba2 (TP-aware)."""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn

AllReduce = Callable[[torch.Tensor], torch.Tensor]


def identity_allreduce(t: torch.Tensor) -> torch.Tensor:
    return t


_EPS: dict[tuple[float, torch.device], torch.Tensor] = {}  # (eps, device) -> 0-dim float64 tensor

# Whether torch.compile can trace `rms_norm` without fixing its input's sizes. torch 2.4's and
# 2.5's take `int[] normalized_shape` and read concrete sizes in their C++ composite: traced, it
# turns every dynamic dimension static, so a compiled decode step recompiled for each batch size
# (up to dynamo's limit of graphs per function). Later ones take `SymInt[]` and keep them symbolic.
RMS_NORM_TRACES_SYMBOLIC = "SymInt[] normalized_shape" in str(torch.ops.aten.rms_norm.default._schema)


def rms_normalize(x: torch.Tensor, eps: float, weight: torch.Tensor | None = None) -> torch.Tensor:
    """x / sqrt(mean(x^2) + eps) over the last dim, times `weight` if given: torch's
    `rms_norm(x, (x.shape[-1],), weight, eps)`, in x's dtype.

    On the CPU (eager) it runs as the row norms, one multiply-add and rsqrt on them, and the
    products: torch 2.13's CPU `rms_norm` is a composite of separate passes that costs about
    seven small ops (measured, one thread, float32, min of runs: (16, 1, 128) 32 -> 20 us,
    (2, 256, 128) 79 -> 56 us, (2, 256, 768) 545 -> 331 us; ~10 % of a small model's prefill
    went to it). The result differs from `rms_norm`'s in the last bits (the mean square is taken
    as a squared norm). GPU tensors and traced code use `rms_norm` (a fused kernel there), except
    traced code where this torch's `rms_norm` would fix the sizes (RMS_NORM_TRACES_SYMBOLIC): there
    the same formula in separate ops, which inductor fuses as it fuses `rms_norm`'s."""
    if torch.compiler.is_compiling() and not RMS_NORM_TRACES_SYMBOLIC:
        y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
        return y if weight is None else y * weight
    if x.device.type != "cpu" or torch.compiler.is_compiling():
        return nn.functional.rms_norm(x, (x.shape[-1],), weight, eps)
    e = _EPS.get((eps, x.device))
    if e is None:  # 0-dim: it takes the norms' dtype in the multiply-add
        e = _EPS.setdefault((eps, x.device), torch.tensor(eps, dtype=torch.float64, device=x.device))
    n = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
    r = torch.addcmul(e, n, n, value=1.0 / x.shape[-1]).rsqrt_()
    y = torch.mul(x, r)
    if weight is None:
        return y
    if torch.is_grad_enabled() and (y.requires_grad or weight.requires_grad):
        return y * weight  # autograd needs y as it was
    return y.mul_(weight)  # normalised, then weighted: the bits of the separate product


class RMSNorm(nn.Module):
    """x / rms(x) * (offset + weight); offset is 0, or 1 for zero-centred weights (Qwen3-Next),
    where the product is taken in float32 as that family does.

    Normalised in float32 (float64 for float64 models) by `rms_normalize`; a float32/float64
    model without offset also multiplies the weight inside that call, which is the same
    product (decided at construction)."""

    def __init__(self, hidden: int, eps: float, dtype: torch.dtype, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.full((hidden,), 1.0 - offset, dtype=dtype), requires_grad=False)
        self.eps = eps
        self.offset = offset
        self.f = torch.promote_types(dtype, torch.float32)
        self.weight_inside = not offset and dtype in (torch.float32, torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (..., hidden) in the model dtype -> the same shape and dtype."""
        if self.weight_inside:
            return rms_normalize(x, self.eps, self.weight)
        h = rms_normalize(x.to(self.f), self.eps)
        if self.offset:
            return (h * (self.offset + self.weight.to(self.f))).to(x.dtype)
        return self.weight * h.to(x.dtype)


class GatedGroupRMSNorm(nn.Module):
    """y = rmsnorm_per_group(y * silu(z)) * weight, groups of `group_size` global channels;
    with `norm_first`, y = rmsnorm_per_group(y) * weight * silu(z) (Falcon-H1's
    mamba_norm_before_gate).

    A rank holds `local_channels` contiguous global channels starting at `first_channel`.
    When a group straddles ranks, the partial sums of squares are all-reduced (one
    (…, n_groups) tensor per call, zero outside this rank's groups).
    """

    def __init__(self, local_channels: int, first_channel: int, group_size: int, n_groups: int,
                 eps: float, dtype: torch.dtype, allreduce: AllReduce, norm_first: bool = False):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(local_channels, dtype=dtype), requires_grad=False)
        self.norm_first = norm_first
        self.eps = eps
        self.group_size = group_size
        self.n_groups = n_groups
        self.first = first_channel
        self.split = local_channels < group_size  # a group spans several ranks
        # one whole group on this rank (Bamba, and most models at TP 1): the weight goes into the
        # rms_norm call, which multiplies it after normalising as the separate product did
        self.weight_inside = local_channels == group_size and first_channel % group_size == 0
        self.allreduce = allreduce

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z: (..., local_channels); y may be float32/64, z in model dtype. Returns y's dtype."""
        f = y.dtype
        gate = torch.nn.functional.silu(z.to(f))
        h = y if self.norm_first else y * gate
        if self.weight_inside:
            h = rms_normalize(h, self.eps, self.weight.to(f))
            return h * gate if self.norm_first else h
        if not self.split:
            g = h.view(*h.shape[:-1], -1, self.group_size)
            h = rms_normalize(g, self.eps).view(h.shape)
        else:
            grp = self.first // self.group_size
            partial = torch.zeros(*h.shape[:-1], self.n_groups, dtype=f, device=h.device)
            partial[..., grp] = h.pow(2).sum(-1)
            total = self.allreduce(partial)[..., grp : grp + 1]
            h = h * torch.rsqrt(total / self.group_size + self.eps)
        h = self.weight.to(f) * h
        return h * gate if self.norm_first else h


class SiluGate(nn.Module):
    """y * silu(z), no normalisation and no weight (Falcon-H1 without mamba_rms_norm)."""

    def forward(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y, z: (..., local_channels). Returns y's dtype."""
        return y * torch.nn.functional.silu(z.to(y.dtype))
