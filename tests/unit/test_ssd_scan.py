"""The C prefill scan (kernels/ssd_scan.c) equals the token-by-token recurrence, in place on
pool rows, with captures part-way; its refusals; and a model through it (and the C convolution)
equals the torch scan."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import mixer_switch_outputs
from hyrax.actors.model.ssd import ssd_sequential
from hyrax.actors.model.ssd_scan import available, ssd_scan_rows_
from test_ssd import inputs

pytestmark = pytest.mark.skipif(available() is not None, reason=f"the kernel does not build here: {available()}")


def _pool(s0: torch.Tensor, rows: list[int], slots: int, seed: int = 3) -> torch.Tensor:
    pool = torch.randn(slots, *s0.shape[1:], generator=torch.Generator().manual_seed(seed))
    pool[rows] = s0.float()
    return pool


@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("T", [1, 5, 13])
def test_the_scan_equals_the_recurrence_and_leaves_the_state_in_its_row(groups, T):
    x, dt, A, Bm, Cm, D, s0 = inputs(3, T, groups, torch.float64, seed=T)
    dt[1, T // 2:] = 0  # sequence 1 is shorter: padding carries dt = 0
    rows = [4, 0, 2]
    pool = _pool(s0, rows, 6)
    untouched = pool[[1, 3, 5]].clone()
    y, caps = ssd_scan_rows_(pool, torch.tensor(rows), *(t.float() for t in (x, dt, A, Bm, Cm, D)))
    y_ref, s_ref = ssd_sequential(x, dt, A, Bm, Cm, D, s0)
    assert caps is None and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), y_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(pool[rows].double(), s_ref, atol=2e-5, rtol=1e-5)
    assert torch.equal(pool[[1, 3, 5]], untouched)  # no other row written


def test_captures_are_the_states_part_way():
    x, dt, A, Bm, Cm, D, s0 = inputs(2, 9, 2, torch.float64, seed=5)
    pool = _pool(s0, [1, 0], 3)
    seqs, lens = torch.tensor([0, 1, 0]), torch.tensor([3, 8, 7])
    _, caps = ssd_scan_rows_(pool, torch.tensor([1, 0]), *(t.float() for t in (x, dt, A, Bm, Cm, D)), (seqs, lens))
    for i, (b, n) in enumerate(zip(seqs.tolist(), lens.tolist())):
        _, want = ssd_sequential(x[b:b + 1, :n], dt[b:b + 1, :n], A, Bm[b:b + 1, :n], Cm[b:b + 1, :n], D, s0[b:b + 1])
        torch.testing.assert_close(caps[i].double(), want[0], atol=2e-5, rtol=1e-5)


def test_a_row_outside_the_pool_or_shared_is_refused_and_nothing_is_written():
    x, dt, A, Bm, Cm, D, s0 = (t.float() for t in inputs(2, 4, 1, torch.float64))
    pool = _pool(s0, [0, 1], 2)
    before = pool.clone()
    with pytest.raises(RuntimeError, match="outside the pool"):
        ssd_scan_rows_(pool, torch.tensor([0, 2]), x, dt, A, Bm, Cm, D)
    with pytest.raises(ValueError, match="share a state row"):
        ssd_scan_rows_(pool, torch.tensor([1, 1]), x, dt, A, Bm, Cm, D)
    with pytest.raises(ValueError, match="float32"):
        ssd_scan_rows_(pool.double(), torch.tensor([0, 1]), x, dt, A, Bm, Cm, D)
    assert torch.equal(pool, before)


@pytest.mark.parametrize("layout", ["mamba", "full_swa_mamba"])
def test_a_model_through_the_c_scan_decodes_what_the_torch_scan_decodes(layout, monkeypatch):
    """Chunked prefill (several chunks per prompt), mixed steps and forced retraction: the same
    greedy tokens with the prefill recurrence in C as with the chunked torch scan, and the C
    scan did run."""
    import hyrax.actors.model.mamba2 as mamba2

    calls = []
    real = mamba2.ssd_scan_rows_
    monkeypatch.setattr(mamba2, "ssd_scan_rows_", lambda *a: (calls.append(a[2].shape[1]), real(*a))[1])
    outs = mixer_switch_outputs(layout, "native_kernels", native_step=False)  # the scan, not the whole step
    assert calls and max(calls) > 1
    assert outs[0] == outs[1]
