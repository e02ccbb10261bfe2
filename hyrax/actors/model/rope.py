"""Rotary position embedding on the first `rotary_dim` channels of each head (HF convention:
the rotated part is split in two halves, `rotate_half`)."""
from __future__ import annotations

import torch


class Rope:
    def __init__(self, head_dim: int, rotary_dim: int, theta: float, dtype: torch.dtype, device=None):
        self.rotary_dim = rotary_dim
        f = torch.float64 if dtype == torch.float64 else torch.float32
        self.inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=f, device=device) / rotary_dim))
        self.dtype = dtype

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions: (B, T) -> cos, sin: (B, T, 1, rotary_dim) in the model dtype."""
        freqs = positions[..., None].to(self.inv_freq.dtype) * self.inv_freq.to(positions.device)
        emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
        return emb.cos().to(self.dtype), emb.sin().to(self.dtype)

    def apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x: (B, T, heads, head_dim)."""
        r = self.rotary_dim
        rot, rest = x[..., :r], x[..., r:]
        half = r // 2
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
        return torch.cat((rot * cos + rotated * sin, rest), dim=-1)
