"""The rotary embedding equals the Hugging Face form (rotate_half on the first rotary_dim
channels, the rest passed through) for full, partial and absent rotary parts."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.rope import Rope


def hf_rotate(x: torch.Tensor, positions: torch.Tensor, rotary_dim: int, theta: float) -> torch.Tensor:
    """x: (B, T, H, D), positions: (B, T) -> the rotated x: angles in float32 (as HF computes
    them), the rotation in float64."""
    x = x.double()
    inv = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
    emb = torch.cat([positions[..., None].float() * inv] * 2, dim=-1)[:, :, None].double()
    rot, rest = x[..., :rotary_dim], x[..., rotary_dim:]
    half = rotary_dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), dim=-1)
    return torch.cat((rot * emb.cos() + rotated * emb.sin(), rest), dim=-1)


@pytest.mark.parametrize("head_dim,rotary_dim", [(32, 32), (32, 16), (256, 64), (10, 8), (16, 0)],
                         ids=["full", "half", "quarter", "ragged_blocks", "none"])
def test_rotation_matches_rotate_half(head_dim, rotary_dim):
    g = torch.Generator().manual_seed(0)
    rope = Rope(head_dim, rotary_dim, 10000.0, torch.float32)
    positions = torch.randint(0, 4000, (2, 5), generator=g)
    x = torch.randn(2, 5, 3, head_dim, generator=g)
    out = rope.apply(x, *rope.cos_sin(positions))
    torch.testing.assert_close(out.double(), hf_rotate(x, positions, rotary_dim, 10000.0), atol=2e-5, rtol=1e-5)
