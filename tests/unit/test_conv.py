"""The depthwise causal conv step (a sum over kernel taps) equals torch's grouped conv1d over
each whole sequence, and keeps each sequence's last K-1 inputs as its state."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from hyrax.actors.model.conv import causal_conv_step

C, K = 6, 4


def reference(history: torch.Tensor, x: torch.Tensor, weight, bias) -> torch.Tensor:
    """history: (C, K-1) earlier inputs, x: (T, C) -> silu(conv1d) at x's T positions, (T, C)."""
    seq = torch.cat([history, x.t()], dim=1)[None].double()
    out = nn.functional.conv1d(seq, weight.double(), None if bias is None else bias.double(), groups=C)
    return nn.functional.silu(out)[0].t()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("q_lens", [[1, 1, 1], [5, 2, 1], [9, 9, 9]], ids=["decode", "ragged", "equal"])
def test_conv_step_matches_grouped_conv1d_and_keeps_each_sequences_last_inputs(dtype, with_bias, q_lens):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(C, 1, K, generator=g).to(dtype)
    bias = torch.randn(C, generator=g).to(dtype) if with_bias else None
    pool = torch.randn(5, C, K - 1, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 4])
    T = max(q_lens)
    x = torch.randn(len(q_lens), T, C, generator=g).to(dtype)
    for b, n in enumerate(q_lens):
        x[b, n:] = 7.0  # padding, must not reach the state
    before = pool.clone()
    out = causal_conv_step(x, pool, slots, torch.tensor(q_lens), weight, bias)
    assert out.shape == x.shape and out.dtype == dtype and out.is_contiguous()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for b, n in enumerate(q_lens):
        want = reference(before[slots[b]], x[b, :n], weight, bias)
        torch.testing.assert_close(out[b, :n].double(), want, atol=tol, rtol=tol)
        full = torch.cat([before[slots[b]], x[b, :n].t()], dim=1)
        torch.testing.assert_close(pool[slots[b]], full[:, -(K - 1):])
    assert torch.equal(pool[[1, 2]], before[[1, 2]])  # other slots untouched
