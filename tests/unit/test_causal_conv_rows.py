"""The C causal convolution (kernels/causal_conv.c) equals the torch step on the same rows."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.causal_conv_rows import available, causal_conv_rows_
from hyrax.actors.model.conv import causal_conv_step

pytestmark = pytest.mark.skipif(available() is not None, reason=f"the kernel does not build here: {available()}")


@pytest.mark.parametrize("T", [1, 2, 7])
@pytest.mark.parametrize("K", [2, 4])
@pytest.mark.parametrize("with_bias", [True, False])
def test_the_kernel_equals_the_torch_step_and_leaves_the_same_states(T, K, with_bias):
    g = torch.Generator().manual_seed(T * 10 + K)
    B, C = 3, 40
    wide = torch.randn(B, T, C + 9, generator=g)  # x as a slice of a wider projection, as in the model
    x = wide[:, :, 5:5 + C]
    pool = torch.randn(6, C, K - 1, generator=g)
    rows = torch.tensor([4, 1, 2])
    q_lens = torch.tensor([T, max(T - 1, 1), 1])  # padding after each sequence's last token
    weight = torch.randn(C, 1, K, generator=g)
    bias = torch.randn(C, generator=g) if with_bias else None
    want_pool = pool.clone()
    want = causal_conv_step(x, want_pool, rows, q_lens, weight, bias)
    got = causal_conv_rows_(x, pool, rows, q_lens, weight, bias)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    assert torch.equal(pool, want_pool)  # states are copies of inputs: bit for bit, other rows untouched


def test_refusals_leave_the_pool_untouched():
    x = torch.randn(2, 3, 8)
    pool = torch.randn(2, 8, 3)
    before = pool.clone()
    w = torch.randn(8, 1, 4)
    with pytest.raises(RuntimeError, match="outside the pool"):
        causal_conv_rows_(x, pool, torch.tensor([0, 5]), torch.tensor([3, 3]), w, None)
    with pytest.raises(ValueError, match="share a state row"):
        causal_conv_rows_(x, pool, torch.tensor([1, 1]), torch.tensor([3, 3]), w, None)
    with pytest.raises(ValueError, match="float32"):
        causal_conv_rows_(x.double(), pool, torch.tensor([0, 1]), torch.tensor([3, 3]), w, None)
    assert torch.equal(pool, before)
