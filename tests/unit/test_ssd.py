"""The chunked SSD scan and the one-step update equal the plain Mamba2 recurrence."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.ssd import ssd_chunked, ssd_sequential, ssd_step

H, P, N, CHUNK = 4, 3, 5, 4
TOL = {torch.float64: 1e-10, torch.float32: 1e-5}


def inputs(batch: int, T: int, groups: int, dtype, seed: int = 0, init: bool = True):
    """Random SSD inputs: x (B,T,H,P), dt (B,T,H) > 0, A (H,) < 0, Bm/Cm (B,T,G,N), D (H,),
    init_state (B,H,P,N) (zeros when `init` is False)."""
    g = torch.Generator().manual_seed(seed)

    def r(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x = r(batch, T, H, P)
    dt = torch.nn.functional.softplus(r(batch, T, H))
    A = -torch.exp(torch.rand(H, generator=g, dtype=torch.float64) * 2 - 1)
    Bm, Cm, D = r(batch, T, groups, N), r(batch, T, groups, N), r(H)
    s0 = r(batch, H, P, N) if init else torch.zeros(batch, H, P, N, dtype=torch.float64)
    return [t.to(dtype) for t in (x, dt, A, Bm, Cm, D, s0)]


def close(a, b, dtype):
    torch.testing.assert_close(a, b, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("T", [3, 8, 13], ids=["shorter_than_chunk", "multiple_of_chunk", "ragged"])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("init", [False, True], ids=["zero_state", "given_state"])
def test_chunked_scan_matches_sequential_recurrence(dtype, T, groups, init):
    x, dt, A, Bm, Cm, D, s0 = inputs(2, T, groups, dtype, init=init)
    y, s = ssd_chunked(x, dt, A, Bm, Cm, D, CHUNK, s0)
    # the reference runs in float64, so float32 is measured against exact math
    y_ref, s_ref = ssd_sequential(*(t.double() for t in (x, dt, A, Bm, Cm, D, s0)))
    assert y.dtype == s.dtype == dtype
    close(y, y_ref.to(dtype), dtype)
    close(s, s_ref.to(dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("groups", [1, 2])
def test_chunked_prefill_then_step_by_step_decode_matches_sequential(dtype, groups):
    T, prefill = 17, 6
    x, dt, A, Bm, Cm, D, s0 = inputs(2, T, groups, dtype, seed=1)
    y_ref, s_ref = ssd_sequential(x, dt, A, Bm, Cm, D, s0)
    # prefill in two chunked calls (the second starts from the first's state) ...
    y1, s = ssd_chunked(x[:, :4], dt[:, :4], A, Bm[:, :4], Cm[:, :4], D, CHUNK, s0)
    y2, s = ssd_chunked(x[:, 4:prefill], dt[:, 4:prefill], A, Bm[:, 4:prefill], Cm[:, 4:prefill], D, CHUNK, s)
    ys = [y1, y2]
    # ... then one token at a time
    for t in range(prefill, T):
        yt, s = ssd_step(s, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D)
        ys.append(yt[:, None])
    close(torch.cat(ys, dim=1), y_ref, dtype)
    close(s, s_ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_right_padding_with_zero_dt_leaves_the_final_state_of_the_unpadded_run(dtype):
    lens = [13, 6]
    x, dt, A, Bm, Cm, D, s0 = inputs(2, max(lens), 2, dtype, seed=2)
    # padding carries garbage everywhere except dt, which is 0 as the model sets it
    dt[1, lens[1]:] = 0
    y, s = ssd_chunked(x, dt, A, Bm, Cm, D, CHUNK, s0)
    n = lens[1]
    y_alone, s_alone = ssd_chunked(x[1:, :n], dt[1:, :n], A, Bm[1:, :n], Cm[1:, :n], D, CHUNK, s0[1:])
    close(s[1:], s_alone, dtype)
    close(y[1:, :n], y_alone, dtype)
    # mutation check: with non-zero dt at the padding the state would move
    dt[1, n:] = 0.5
    _, s_bad = ssd_chunked(x, dt, A, Bm, Cm, D, CHUNK, s0)
    assert (s_bad[1] - s_alone[0]).abs().max() > 1e-3


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_decays_past_underflow_match_the_recurrence(dtype):
    """Log-decays far below float32's exp range (dt * A down to -200 a token, sums to -3000 over
    a chunk) are floored before the exp (LOG_DECAY_FLOOR): the scan, the one-step update and
    the state-after shortcut still equal the plain recurrence, whose own exp underflows to 0."""
    from hyrax.actors.model.ssd import ssd_state_after

    T = 13
    x, dt, A, Bm, Cm, D, s0 = inputs(2, T, 2, dtype, seed=3)
    dt[:, ::3] *= 40.0  # every third token forgets nearly everything before it
    A = A * 5.0
    y_ref, s_ref = ssd_sequential(*(t.double() for t in (x, dt, A, Bm, Cm, D, s0)))
    y, s = ssd_chunked(x, dt, A, Bm, Cm, D, CHUNK, s0)

    def close(a, b):  # the large dt makes values of ~10: float32 is held to its relative precision
        torch.testing.assert_close(a, b.to(dtype), atol=TOL[dtype], rtol=TOL[dtype])

    close(y, y_ref)
    close(s, s_ref)
    close(ssd_state_after(x, dt, A, Bm, s0), s_ref)
    st = s0.clone()
    for t in range(T):
        yt, st = ssd_step(st, x[:, t], dt[:, t], A, Bm[:, t], Cm[:, t], D)
    close(st, s_ref)
    close(yt, y_ref[:, -1])


def test_chunk_decay_matrix_is_exactly_lower_triangular():
    """exp(a_{s+1} + ... + a_l) for l >= s: 1 on the diagonal, exact zeros above it, also where
    the sums fall past exp's range."""
    from hyrax.actors.model.ssd import _decay

    a = -torch.rand(3, 8, dtype=torch.float32) * 300.0
    d = _decay(a)
    assert torch.equal(torch.triu(d, diagonal=1), torch.zeros_like(d))
    assert torch.equal(torch.diagonal(d, dim1=-2, dim2=-1), torch.ones(3, 8))
    ref = torch.exp(torch.stack([torch.stack([a[b, s + 1:l + 1].double().sum() for s in range(8)]) for b in range(3)
                                 for l in range(8)]).view(3, 8, 8)).float()
    torch.testing.assert_close(torch.tril(d), torch.tril(ref), atol=1e-30, rtol=1e-5)
