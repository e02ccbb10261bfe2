"""`rms_normalize` (hyrax/actors/model/norm.py), the CPU RMSNorm built from row norms: the same
values as torch's `rms_norm` at every shape and dtype the models use, gradients included."""
from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from hyrax.actors.model.norm import rms_normalize


@pytest.mark.parametrize("shape", [(1, 1, 128), (16, 1, 128), (3, 7, 48), (2, 5, 4, 32), (9, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("weighted", [False, True], ids=["no_weight", "weight"])
@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_equals_torch_rms_norm(shape, dtype, weighted, eps):
    g = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(dtype)
    x[..., 0] += 5.0  # rows far from zero mean: a mean-subtracting norm would not pass
    w = (1 + 0.3 * torch.randn(shape[-1], generator=g, dtype=torch.float64)).to(dtype) if weighted else None
    got = rms_normalize(x, eps, w)
    want = F.rms_norm(x, (shape[-1],), w, eps)
    assert got.dtype == dtype and got.shape == x.shape
    tol = 1e-6 if dtype == torch.float32 else 1e-13
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)


def test_eps_matters_for_small_rows():
    """A row of tiny values: eps dominates the mean square, as in torch's rms_norm."""
    x = torch.full((2, 8), 1e-4)
    torch.testing.assert_close(rms_normalize(x, 1e-2), F.rms_norm(x, (8,), None, 1e-2), rtol=1e-6, atol=1e-9)


def test_gradients_match_torch():
    g = torch.Generator().manual_seed(2)
    x0 = torch.randn(4, 3, 16, generator=g, dtype=torch.float64)
    w0 = 1 + 0.1 * torch.randn(16, generator=g, dtype=torch.float64)
    grads = []
    for fn in (lambda x, w: rms_normalize(x, 1e-5, w), lambda x, w: F.rms_norm(x, (16,), w, 1e-5)):
        x, w = x0.clone().requires_grad_(), w0.clone().requires_grad_()
        (fn(x, w) * torch.arange(16, dtype=torch.float64)).sum().backward()
        grads.append((x.grad, w.grad))
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-10, atol=1e-12)
