"""Rotary position embedding on the first `rotary_dim` channels of each head (HF convention:
the rotated part is split in two halves, `rotate_half`)."""
from __future__ import annotations

import torch
from torch import nn


class RopeFrequencies(nn.Module):
    """`inv_freq` (rotary_dim / 2,) and `partner` (head_dim,) as buffers: the model that
    registers this module moves them with its weights (`model.to(device)`), so a step never
    copies them from the host. Not persistent: checkpoints do not carry them.

    `partner[i]` is the channel that rotate_half moves into channel i: i + r/2 for the first
    half of the rotary part, i - r/2 for the second, i itself past `rotary_dim` (whose sin is 0)."""

    def __init__(self, rotary_dim: int, theta: float, dtype: torch.dtype, device=None, head_dim: int | None = None):
        super().__init__()
        f = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=f, device=device) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        half, hd = rotary_dim // 2, head_dim or rotary_dim
        partner = [*range(half, rotary_dim), *range(half), *range(rotary_dim, hd)]
        self.register_buffer("partner", torch.tensor(partner, dtype=torch.long, device=device), persistent=False)


class Rope:
    """The rotation; its frequencies live in `self.freqs`, which the model registers as a submodule.

    `cos_sin` builds whole-head tables once per step (cos 1 and sin 0 past `rotary_dim`, sin
    negated where rotate_half negates), so `apply` is one gather of partner channels and one
    multiply-add per tensor instead of slicing, negating and concatenating the halves."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, dtype: torch.dtype, device=None):
        self.rotary_dim = rotary_dim
        self.head_dim = head_dim
        self.freqs = RopeFrequencies(rotary_dim, theta, dtype, device, head_dim)
        self.dtype = dtype

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.freqs.inv_freq

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (B, T) on the model's device -> cos, sin: (B, T, 1, head_dim) in the model
        dtype; sin carries rotate_half's sign (negative on the rotary part's first half)."""
        inv_freq = self.freqs.inv_freq
        freqs = positions[..., None].to(inv_freq.dtype) * inv_freq  # (B, T, rotary_dim / 2)
        cos, sin = freqs.cos(), freqs.sin()
        rest = self.head_dim - self.rotary_dim
        parts_cos, parts_sin = [cos, cos], [-sin, sin]
        if rest:
            parts_cos.append(torch.ones_like(cos[..., :1]).expand(*cos.shape[:-1], rest))
            parts_sin.append(torch.zeros_like(sin[..., :1]).expand(*sin.shape[:-1], rest))
        return (torch.cat(parts_cos, dim=-1)[:, :, None].to(self.dtype),
                torch.cat(parts_sin, dim=-1)[:, :, None].to(self.dtype))

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, heads, head_dim); cos, sin from `cos_sin` -> x rotated, same shape."""
        return torch.addcmul(x * cos, x.index_select(-1, self.freqs.partner), sin)
