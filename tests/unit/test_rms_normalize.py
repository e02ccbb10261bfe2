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


def _compiled_over_batch_sizes(fn, sizes=(8, 5, 3)):
    """`fn(x)` through torch.compile (the graphs counted, run as traced), x: (B, 1, 32) with B
    marked dynamic as a compiled decode step marks it, at each size -> (graphs, [(out, x)])."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled = torch.compile(fn, backend=backend)
    runs = []
    for b in sizes:
        x = torch.randn(b, 1, 32, generator=torch.Generator().manual_seed(b))
        torch._dynamo.maybe_mark_dynamic(x, 0)
        runs.append((compiled(x), x))
    return len(graphs), runs


@pytest.mark.parametrize("symbolic", [True, False], ids=["rms_norm", "formula"])
def test_traced_rms_normalize_keeps_the_batch_dimension_dynamic(monkeypatch, symbolic):
    """Traced, one graph serves every batch size, by torch's `rms_norm` where it keeps sizes
    symbolic and by the formula where it would fix them (torch 2.4; simulated here): each size
    fixed recompiled a compiled decode step per batch size."""
    from hyrax.actors.model import norm

    if symbolic and not norm.RMS_NORM_TRACES_SYMBOLIC:
        pytest.skip("this torch's rms_norm fixes sizes when traced")
    monkeypatch.setattr(norm, "RMS_NORM_TRACES_SYMBOLIC", symbolic)
    w = 1 + 0.1 * torch.randn(32, generator=torch.Generator().manual_seed(0))
    graphs, runs = _compiled_over_batch_sizes(lambda x: norm.rms_normalize(x, 1e-5, w))
    assert graphs == 1
    for out, x in runs:
        torch.testing.assert_close(out, F.rms_norm(x, (32,), w, 1e-5), rtol=1e-6, atol=1e-6)


def test_rms_norm_tracing_is_detected_as_this_torch_behaves():
    """RMS_NORM_TRACES_SYMBOLIC says what torch.compile does with this torch's `rms_norm`: one
    graph over batch sizes where it is set, a graph per size where it is not (torch 2.4, 2.5)."""
    from hyrax.actors.model.norm import RMS_NORM_TRACES_SYMBOLIC

    graphs, _ = _compiled_over_batch_sizes(lambda x: F.rms_norm(x, (32,), None, 1e-5), sizes=(8, 5))
    assert graphs == (1 if RMS_NORM_TRACES_SYMBOLIC else 2)
