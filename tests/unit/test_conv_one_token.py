"""The one-token conv step (every sequence of a decode step has its one token) computes what the
multi-token path computes for a sequence with one valid token: the same new state rows bit for
bit, other slots untouched, and the same outputs up to a rounding (the same multiply-adds in the
same order; a kernel may fuse one where the other does not)."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.conv import causal_conv_step


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=str)
@pytest.mark.parametrize("with_bias", [True, False], ids=["bias", "no_bias"])
@pytest.mark.parametrize("C,K", [(6, 4), (1664, 4), (5, 2), (7, 3)], ids=str)
def test_one_token_step_equals_the_multi_token_path(dtype, with_bias, C, K):
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(C, 1, K, generator=g).to(dtype)
    bias = torch.randn(C, generator=g).to(dtype) if with_bias else None
    pool = torch.randn(9, C, K - 1, generator=g).to(dtype)
    slots = torch.tensor([3, 0, 8, 5])
    B = len(slots)
    x = torch.randn(B, 2, C, generator=g).to(dtype)
    x[:, 1] = 7.0  # padding of the two-token batch, must not reach its state
    ones = torch.ones(B, dtype=torch.long)

    want_pool = pool.clone()
    want = causal_conv_step(x, want_pool, slots, ones, weight, bias)[:, :1]  # T = 2: the multi-token path
    got_pool = pool.clone()
    got = causal_conv_step(x[:, :1], got_pool, slots, ones, weight, bias)  # T = 1
    assert got.shape == (B, 1, C) and got.dtype == dtype and got.is_contiguous()
    tol = {torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float64: 1e-14}[dtype]
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got_pool, want_pool)
    assert torch.equal(got_pool[[1, 2, 4, 6, 7]], pool[[1, 2, 4, 6, 7]])
    for b, s in enumerate(slots.tolist()):  # the window moved one token on
        assert torch.equal(got_pool[s, :, :-1], pool[s, :, 1:]) and torch.equal(got_pool[s, :, -1], x[b, 0])


def test_one_token_step_reads_inputs_that_are_a_strided_slice():
    """In a model x is a column slice of in_proj's output (rows longer than C)."""
    g = torch.Generator().manual_seed(1)
    C, K = 10, 4
    wide = torch.randn(3, 1, 3 * C, generator=g)
    x = wide[:, :, C:2 * C]
    weight, pool = torch.randn(C, 1, K, generator=g), torch.randn(4, C, K - 1, generator=g)
    slots, ones = torch.tensor([2, 0, 3]), torch.ones(3, dtype=torch.long)
    p1, p2 = pool.clone(), pool.clone()
    assert torch.equal(causal_conv_step(x, p1, slots, ones, weight, None),
                       causal_conv_step(x.contiguous(), p2, slots, ones, weight, None))
    assert torch.equal(p1, p2)
