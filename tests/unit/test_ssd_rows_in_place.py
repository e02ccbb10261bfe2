"""The Mamba2 decode step on SSM pool rows where they lie (`ssd_step_rows_`, used on the CPU for
large state rows) against the gathered step (`ssd_step` on `index_select`ed rows, scattered
back): the same new state bit for bit, the same outputs within float rounding, and every
other row of the pool untouched; in a model, the same logits and pools over a decode run."""
from __future__ import annotations

import pytest
import torch

from tiny_models import fresh_pools, random_model, shuffled_pages, slots_for, step, tiny_config

from hyrax.actors.model.batch import SeqSlice
from hyrax.actors.model.mamba2 import ROWS_IN_PLACE_MIN_BYTES, Mamba2Mixer, rows_on_host
from hyrax.actors.model.ssd import ssd_step, ssd_step_rows_


def step_inputs(B: int, H: int, P: int, G: int, N: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    dt = torch.rand(B, H, generator=g, dtype=torch.float64).to(dtype) * 0.5
    A = -torch.rand(H, generator=g, dtype=torch.float64).to(dtype) - 0.1
    return r(B, H, P), dt, A, r(B, G, N), r(B, G, N), r(H)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("groups", [1, 2])
@pytest.mark.parametrize("rows", [[3, 4, 5, 6], [6, 5, 4, 3], [9, 0, 4, 7], [2]], ids=str)
def test_rows_in_place_match_the_gathered_step_and_leave_other_rows_alone(dtype, groups, rows):
    H, P, N = 4, 6, 5
    pool = torch.randn(10, H, P, N, generator=torch.Generator().manual_seed(1), dtype=torch.float64).to(dtype)
    inputs = step_inputs(len(rows), H, P, groups, N, dtype)
    index = torch.tensor(rows)

    want_pool = pool.clone()
    want_y, new_state = ssd_step(want_pool.index_select(0, index), *inputs)
    want_pool.index_copy_(0, index, new_state)

    got_pool = pool.clone()
    got_y = ssd_step_rows_(got_pool, rows, *inputs)
    assert got_y.shape == want_y.shape and got_y.dtype == dtype
    assert torch.equal(got_pool, want_pool)  # written rows bit for bit, the others unchanged
    others = [r for r in range(10) if r not in rows]
    assert torch.equal(got_pool[others], pool[others])
    tol = 1e-5 if dtype == torch.float32 else 1e-12
    torch.testing.assert_close(got_y, want_y, rtol=tol, atol=tol)


def test_rows_on_host_only_for_an_eager_cpu_pool_without_autograd_recording():
    pool = torch.zeros(3, 2)
    x = torch.ones(2, requires_grad=True)
    assert rows_on_host(pool, x.detach())
    with torch.no_grad():
        assert rows_on_host(pool, x)
    assert not rows_on_host(pool, x)  # training: the write is recorded, so the gathered form
    assert not rows_on_host(pool.to("meta"), x.detach())


def test_large_state_rows_choose_the_in_place_step_at_construction():
    small = random_model(tiny_config("mamba"), dtype=torch.float32)
    assert not any(m.rows_in_place for m in small.modules() if isinstance(m, Mamba2Mixer))
    # 4 heads x 64 x 64 float32 = 64 kB rows
    big = random_model(tiny_config("mamba", mamba_d_head=64, mamba_d_state=64), dtype=torch.float32)
    mixers = [m for m in big.modules() if isinstance(m, Mamba2Mixer)]
    assert 4 * 64 * 64 * 4 >= ROWS_IN_PLACE_MIN_BYTES and all(m.rows_in_place for m in mixers)


def set_rows_in_place(model, value: bool) -> None:
    for m in model.modules():
        if isinstance(m, Mamba2Mixer):
            m.rows_in_place = value


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("slots", [[0, 1, 2], [3, 0, 2]], ids=str)
def test_decode_run_in_place_matches_the_gathered_model(dtype, slots):
    """Prefill three prompts, then decode five tokens each with the in-place step and with the
    gathered step: identical pools (every row, the unused one included) and logits."""
    model = random_model(tiny_config("swa_mamba"), dtype=dtype)
    prompts = [[5, 9, 1, 3, 7], [2, 8], [11, 4, 6, 10]]
    runs = {}
    for in_place in (False, True):
        set_rows_in_place(model, in_place)
        pools = fresh_pools(model)
        for name in pools:  # non-zero free rows, to see that nothing else is written
            pools[name].normal_(generator=torch.Generator().manual_seed(3))
        pages = [shuffled_pages(model, 4, seed=i) for i in range(3)]
        seqs = [SeqSlice(p, 0, pages[i], slots_for(model, slots[i])) for i, p in enumerate(prompts)]
        logits = [step(model, pools, seqs)]
        for t in range(5):
            seqs = [SeqSlice([(7 * i + t) % 64], len(p) + t, pages[i], slots_for(model, slots[i]))
                    for i, p in enumerate(prompts)]
            logits.append(step(model, pools, seqs))
        runs[in_place] = (logits, {k: v.clone() for k, v in pools.items()})
    set_rows_in_place(model, False)
    (want_logits, want_pools), (got_logits, got_pools) = runs[False], runs[True]
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for w, g in zip(want_logits, got_logits):
        torch.testing.assert_close(g, w, rtol=tol, atol=tol)
    for name in want_pools:
        torch.testing.assert_close(got_pools[name], want_pools[name], rtol=tol, atol=tol)
