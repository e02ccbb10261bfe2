"""Rotary position embedding on the first `rotary_dim` channels of each head (HF convention:
the rotated part is split in two halves, `rotate_half`)."""
from __future__ import annotations

import torch
from torch import nn


class RopeFrequencies(nn.Module):
    """`inv_freq` (rotary_dim / 2,) as a buffer: the model that registers this module moves it
    with its weights (`model.to(device)`), so a step never copies it from the host. Not
    persistent: checkpoints do not carry it."""

    def __init__(self, rotary_dim: int, theta: float, dtype: torch.dtype, device=None):
        super().__init__()
        f = torch.float64 if dtype == torch.float64 else torch.float32
        inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=f, device=device) / rotary_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)


class Rope:
    """The rotation; its frequencies live in `self.freqs`, which the model registers as a submodule."""

    def __init__(self, head_dim: int, rotary_dim: int, theta: float, dtype: torch.dtype, device=None):
        self.rotary_dim = rotary_dim
        self.freqs = RopeFrequencies(rotary_dim, theta, dtype, device)
        self.dtype = dtype

    @property
    def inv_freq(self) -> torch.Tensor:
        return self.freqs.inv_freq

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (B, T) on the model's device -> cos, sin: (B, T, 1, rotary_dim) in the model dtype."""
        inv_freq = self.freqs.inv_freq
        freqs = positions[..., None].to(inv_freq.dtype) * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, heads, head_dim)."""
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)
