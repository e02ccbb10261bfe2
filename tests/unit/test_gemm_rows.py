"""Row plans for CPU linear layers (hyrax/actors/model/gemm_rows.py): the choice among plain,
padded and split products from measured times, and that every plan computes the same product."""
from __future__ import annotations

import ctypes

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from hyrax.actors.model.gemm_rows import PlannedLinear, RowPlan, best_pieces, plan_rows, run_pieces


def _mkl_like() -> list[float]:
    """MKL on the dev VM, (4096, 768): rows go three at a time below 16, then a faster kernel."""
    return [0.55e-3 * ((m + 2) // 3) if m < 16 else 1.7e-3 for m in range(1, 17)]


def test_pads_the_slow_small_counts_to_the_fast_kernel():
    plan = best_pieces(_mkl_like())
    assert all(plan[m - 1] is None for m in range(1, 10))  # 1-9 rows cost at most 1.65 ms: plain
    for m in range(10, 16):  # 2.2 - 2.75 ms plain, 1.7 ms padded to 16
        assert plan[m - 1] == ((m, 16),)
    assert plan[15] is None


def test_splits_below_a_cliff():
    """The demo model's (128, 256) MLP weight: ~10 us up to 10 rows, ~45 us from 11."""
    seconds = [10e-6 if m <= 10 else 45e-6 for m in range(1, 17)]
    plan = best_pieces(seconds)
    assert all(plan[m - 1] is None for m in range(1, 11))
    for m in range(11, 17):
        pieces = plan[m - 1]
        assert pieces is not None and len(pieces) == 2
        assert sum(r for r, _ in pieces) == m and all(run_as == r <= 10 for r, run_as in pieces)


@pytest.mark.parametrize("seconds", [
    [1e-5 * m for m in range(1, 17)],  # proportional to the rows: nothing to gain
    [1e-3] * 16,  # flat: splitting only adds calls
    [1e-3 if m != 12 else 1.2e-3 for m in range(1, 17)],  # 12 rows 20 % slower than 13: inside the margin
])
def test_plain_where_no_plan_is_clearly_cheaper(seconds):
    assert best_pieces(seconds) == (None,) * 16


@pytest.mark.parametrize("pieces", [((5, 16),), ((3, 3), (4, 4)), ((2, 6), (7, 7), (1, 3)), ((6, 6), (4, 9))])
@pytest.mark.parametrize("bias", [False, True])
def test_run_pieces_is_the_plain_product(pieces, bias):
    g = torch.Generator().manual_seed(0)
    m = sum(r for r, _ in pieces)
    x = torch.randn(m, 24, generator=g, dtype=torch.float64)
    w = torch.randn(40, 24, generator=g, dtype=torch.float64)
    b = torch.randn(40, generator=g, dtype=torch.float64) if bias else None
    torch.testing.assert_close(run_pieces(x, w, b, pieces), F.linear(x, w, b), rtol=1e-12, atol=1e-12)


def test_planned_linear_keeps_shape_and_falls_back_past_the_plan():
    lin = nn.Linear(8, 6, dtype=torch.float64)
    ref = F.linear
    plan_rows(lin)
    assert type(lin) is PlannedLinear
    lin.row_plan = RowPlan((None, ((2, 4),), ((1, 1), (2, 2))))  # 2 rows padded, 3 split; 1 and 4+ plain
    for shape in [(1, 8), (2, 8), (3, 1, 8), (1, 3, 8), (4, 8), (2, 5, 8), (0, 8)]:
        x = torch.randn(shape, dtype=torch.float64)
        y = lin(x)
        assert y.shape == (*shape[:-1], 6)
        torch.testing.assert_close(y, ref(x, lin.weight, lin.bias), rtol=1e-12, atol=1e-12)


def _forced_plan() -> RowPlan:
    """Every count 1..16 planned: odd counts padded by one row, even ones split in two."""
    return RowPlan(tuple(((m, m + 1),) if m % 2 else ((m // 2, m // 2), (m // 2, m // 2 + 1)) for m in range(1, 17)))


def test_plan_rows_keeps_the_model_and_its_products():
    """Every nn.Linear of a CPU model is planned in place: same parameters (tied ones still
    tied), same state dict, and each layer computes the product its plan covers as a plain
    one does."""
    from tiny_models import randomize_, tiny_config

    from hyrax.actors.model.hybrid import HybridModel

    cfg = tiny_config("full_swa_mamba", tie_word_embeddings=True)
    model = randomize_(HybridModel(cfg, dtype=torch.float64))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    n_linear = sum(type(m) is nn.Linear for m in model.modules())
    assert plan_rows(model) == n_linear > 0
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert model.lm_head.weight is model.model.embed_tokens.weight
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    for lin in (m for m in model.modules() if type(m) is PlannedLinear):
        lin.row_plan = _forced_plan()
        x = torch.randn(16, lin.in_features, dtype=torch.float64)
        for m in range(1, 17):
            torch.testing.assert_close(lin(x[:m]), F.linear(x[:m], lin.weight, lin.bias), rtol=1e-12, atol=1e-12)


def test_plain_products_switches_the_plans_off_and_back():
    from hyrax.actors.model.gemm_rows import plain_products

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
    plan_rows(model)
    with plain_products(model):
        assert [type(m) for m in model] == [nn.Linear, nn.Linear]
    assert [type(m) for m in model] == [PlannedLinear, PlannedLinear]


def test_deterministic_engines_load_without_row_plans():
    """Plans are measured per process, so two processes may run a product differently;
    deterministic mode (numerics that are a pure function of the request) loads every linear
    layer plain, any other CPU engine planned."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.model.demo import DEMO_DIR

    def linear_types(deterministic: bool) -> set[type]:
        model = load_engine(str(DEMO_DIR), EngineConfig(deterministic=deterministic)).executor.rank.model
        return {type(m) for m in model.modules() if isinstance(m, nn.Linear)}

    assert linear_types(True) == {nn.Linear}
    assert linear_types(False) == {PlannedLinear}



def test_a_compiled_planned_linear_does_not_specialise_on_its_row_count():
    """Under torch.compile a planned product runs plain, and the row count is never looked up:
    a lookup made the decode graph specialise on the batch size (one recompile per size, then
    eager past dynamo's recompile limit)."""
    from torch._dynamo.testing import CompileCounter

    lin = nn.Linear(8, 6)
    plan_rows(lin)
    lin.row_plan = _forced_plan()
    counter = CompileCounter()
    f = torch.compile(lin, backend=counter, dynamic=True)
    with torch.no_grad():
        for m in (3, 4, 5, 7, 9):
            x = torch.randn(m, 8)
            torch.testing.assert_close(f(x), F.linear(x, lin.weight, lin.bias))
    assert counter.frame_count == 1


def test_onednn_runs_the_counts_where_it_is_clearly_cheaper_than_mkls_best_way():
    """Measured seconds per kind at 1..16 rows, then at 64 and 256: oneDNN where it costs at most
    0.9 of MKL's best way (a padded plan included), and past 16 rows where it costs at most 0.95
    of MKL at the next measured count (past 256: at 256)."""
    from hyrax.actors.model.gemm_rows import LARGE_ROWS, _plan_from

    mkl = _mkl_like()  # 10-15 rows best padded to 16 (1.7 ms)
    dnn = [0.85 * s for s in mkl[:9]] + [1.6e-3] * 6 + [1.7e-3]  # 1-9 clearly cheaper; 10-15 vs padding: not
    plan = _plan_from({"mkl": mkl + [5e-3, 20e-3], "onednn": dnn + [4e-3, 18.5e-3]})
    assert plan.onednn == (True,) * 9 + (False,) * 7
    assert plan.pieces == best_pieces(mkl)
    assert plan.onednn_large == (True, True)
    assert all(plan.onednn_for(m) for m in (64, 65, 256, 300)) and not plan.onednn_for(12)
    assert not any(plan.onednn_for(m) for m in (17, 40, 63))  # padded to few shapes, these would cost most
    assert LARGE_ROWS == (64, 256)
    mixed = _plan_from({"mkl": mkl + [5e-3, 20e-3], "onednn": dnn + [4.9e-3, 18e-3]})  # 64 rows: within the margin
    assert mixed.onednn_large == (False, True)
    assert [mixed.onednn_for(m) for m in (17, 64, 65, 256, 1000)] == [False, False, True, True, True]
    assert _plan_from({"mkl": mkl + [5e-3, 20e-3]}) == RowPlan(best_pieces(mkl))  # no oneDNN here: MKL only


def test_onednn_meets_few_shapes():
    """oneDNN builds a kernel per shape: past 16 rows its products run on rows rounded up to
    multiples of 16 (to 256) and of 64 (beyond), never fewer than asked."""
    from hyrax.actors.model.gemm_rows import onednn_rows

    rows = [onednn_rows(m) for m in range(1, 4097)]
    assert rows[:16] == list(range(1, 17))
    assert all(r >= m for m, r in enumerate(rows, start=1))
    assert all(r % 16 == 0 and r - m < 16 for m, r in enumerate(rows[16:256], start=17))
    assert all(r % 64 == 0 and r - m < 64 for m, r in enumerate(rows[256:], start=257))
    assert len(set(rows)) == 16 + 15 + 60


@pytest.mark.parametrize("bias", [False, True])
def test_onednn_products_are_the_plain_product(bias, monkeypatch):
    from hyrax.actors.model import gemm_rows

    if gemm_rows._ONEDNN is None:
        pytest.skip("this torch has no oneDNN")
    calls = []
    op = gemm_rows._ONEDNN
    monkeypatch.setattr(gemm_rows, "_ONEDNN", lambda *a: (calls.append(a[0].shape[0]), op(*a))[1])
    lin = nn.Linear(96, 80, bias=bias)
    monkeypatch.setattr(gemm_rows, "_time_rows", lambda *a, **k: 1e-3)  # (no need to time it)
    plan_rows(lin)
    lin.row_plan = RowPlan((None,) * 16, (True,) * 16, (True, True))
    calls.clear()  # (the plan's own timing ran it too)
    for shape in [(1, 96), (5, 96), (3, 4, 96), (16, 96), (40, 96), (2, 150, 96), (64, 96), (5, 61, 96)]:
        x = torch.randn(shape)
        with torch.inference_mode():
            y = lin(x)
            assert y.shape == (*shape[:-1], 80)
            torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [1, 5, 12, 16, 320, 64, 320]  # 40 rows: MKL; 300 and 305 padded to 320


def _onednn_everywhere(monkeypatch) -> nn.Linear:
    """An (80, 96) float32 layer planned to run every row count through oneDNN."""
    from hyrax.actors.model import gemm_rows

    if gemm_rows._ONEDNN is None:
        pytest.skip("this torch has no oneDNN")
    monkeypatch.setattr(gemm_rows, "_time_rows", lambda *a, **k: 1e-3)  # (no need to time it)
    lin = nn.Linear(96, 80)
    plan_rows(lin)
    lin.row_plan = RowPlan((None,) * 16, (True,) * 16, (True, True))
    return lin


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_a_layer_cast_after_planning_runs_its_onednn_counts_plain(dtype, monkeypatch):
    """oneDNN was timed on the float32 weight the layer had when planned: cast since (`.to`), its
    products are F.linear's, not oneDNN's refusal of a double or of a dense bfloat16 weight."""
    lin = _onednn_everywhere(monkeypatch)
    lin.to(dtype)
    for m in (3, 100):
        x = torch.randn(m, 96, dtype=dtype)
        with torch.inference_mode():
            torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias))


def test_a_strided_bias_goes_to_the_blas_not_to_onednn(monkeypatch):
    """oneDNN's linear reads the bias as contiguous: a bias that is a strided view (a shard's) or
    one value expanded over the outputs runs plain, with F.linear's values (strided weights it
    reads right)."""
    lin = _onednn_everywhere(monkeypatch)
    for bias in (torch.randn(160)[::2], torch.randn(1).expand(80)):
        lin.bias = nn.Parameter(bias, requires_grad=False)
        for m in (3, 100):
            x = torch.randn(m, 96)
            with torch.inference_mode():
                torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_only_float32_weights_are_timed_through_onednn(monkeypatch):
    from hyrax.actors.model import gemm_rows

    timed = []
    monkeypatch.setattr(gemm_rows, "_time_rows",
                        lambda w, b, m, product=F.linear, others=(): timed.append(product) or 1e-3)
    monkeypatch.setattr(gemm_rows, "_plans", {})
    gemm_rows.row_plan(torch.zeros(512, 256, dtype=torch.float64), None)
    assert set(timed) == {F.linear}
    gemm_rows.row_plan(torch.zeros(256, 128), None)  # float32, but 128 KB: too small to pay oneDNN's call
    assert gemm_rows.onednn_linear not in timed
    if gemm_rows._ONEDNN is not None:
        gemm_rows.row_plan(torch.zeros(512, 256), None)  # 512 KB
        assert gemm_rows.onednn_linear in timed


def test_a_onednn_that_fails_or_differs_gets_no_plan(monkeypatch):
    from hyrax.actors.model import gemm_rows

    w = torch.randn(512, 256)
    if gemm_rows._ONEDNN is not None:
        assert gemm_rows._onednn_serves(w, None)

    def refuses(*a):
        raise RuntimeError("no dense weights here")

    for op in (refuses, lambda x, w, b, *rest: F.linear(x, w, b) + 1):
        monkeypatch.setattr(gemm_rows, "_ONEDNN", op)
        monkeypatch.setattr(gemm_rows, "_plans", {})
        assert not gemm_rows._onednn_serves(w, None)
        assert gemm_rows.row_plan(w, None).onednn == ()


def _native_or_skip():
    from hyrax.actors.model import gemm_rows

    if not gemm_rows._native_serves(torch.randn(4, 8), None):
        pytest.skip("the native kernel cannot be built here (no C compiler)")
    return gemm_rows


@pytest.mark.parametrize("bias", [False, True])
def test_the_native_kernel_is_the_plain_product(bias):
    """Every tile shape and remainder: rows 1-17 (threes, twos, a last one), outputs 1-9 and 37
    (fours and single rows of the weight), inner sizes 1, 7, 8, 9 and 77 (whole vectors and a
    tail)."""
    gemm_rows = _native_or_skip()
    g = torch.Generator().manual_seed(0)
    for m in range(1, 18):
        for n in (*range(1, 10), 37):
            for k in (1, 7, 8, 9, 77):
                x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
                b = torch.randn(n, generator=g) if bias else None
                torch.testing.assert_close(gemm_rows.native_linear(x, w, b), F.linear(x, w, b),
                                           rtol=1e-5, atol=1e-5, msg=lambda s: f"m={m} n={n} k={k}: {s}")


@pytest.mark.parametrize("bias", [False, True])
def test_the_native_kernel_is_the_plain_product_over_long_rows(bias):
    """Inner sizes the kernel goes over in several blocks, with x's rows copied to a padded
    stride (1536: two whole blocks; 2051: three uneven ones and a tail), rows in one chunk
    and past it (17), outputs in fours and single ones."""
    gemm_rows = _native_or_skip()
    g = torch.Generator().manual_seed(2)
    for m in (1, 2, 3, 4, 16, 17):
        for n in (5, 13):
            for k in (1536, 2051):
                x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
                b = torch.randn(n, generator=g) if bias else None
                torch.testing.assert_close(gemm_rows.native_linear(x, w, b), F.linear(x, w, b),
                                           rtol=1e-4, atol=1e-4, msg=lambda s: f"m={m} n={n} k={k}: {s}")


@pytest.mark.parametrize("k", [203, 2051])
def test_a_native_row_does_not_depend_on_the_rows_beside_it(k):
    """Each output is summed in one order whatever the row count: any subset of rows gives
    exactly the values those rows get in the full product (a BLAS gives no such promise),
    also where the inner size takes several blocks and the rows more than one chunk."""
    gemm_rows = _native_or_skip()
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(17, k, generator=g), torch.randn(45, k, generator=g)
    full = gemm_rows.native_linear(x, w, None)
    for lo in range(17):
        for hi in range(lo + 1, 18):
            assert torch.equal(gemm_rows.native_linear(x[lo:hi].contiguous(), w, None), full[lo:hi]), (lo, hi)


def test_planned_linear_runs_the_native_kernel_where_its_plan_says(monkeypatch):
    gemm_rows = _native_or_skip()
    calls = []
    kernel = gemm_rows._NATIVE
    monkeypatch.setattr(gemm_rows, "_NATIVE", lambda *a: (calls.append(a[4]), kernel(*a))[1])
    lin = nn.Linear(40, 24)
    monkeypatch.setattr(gemm_rows, "_time_rows", lambda *a, **k: 1e-3)  # (no need to time it)
    plan_rows(lin)
    lin.row_plan = RowPlan((None,) * 16, (), (), tuple(m % 2 == 0 for m in range(1, 17)))  # even counts
    calls.clear()
    for shape in [(1, 40), (2, 40), (3, 2, 40), (16, 40), (5, 40), (20, 40), (2, 3, 40)]:
        x = torch.randn(shape)
        with torch.inference_mode():
            y = lin(x)
        assert y.shape == (*shape[:-1], 24)
        torch.testing.assert_close(y, F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [2, 6, 16, 6]
    with torch.inference_mode():  # a view whose rows are not contiguous runs on a contiguous copy
        x = torch.randn(40, 4).t()
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [2, 6, 16, 6, 4]
    with torch.inference_mode():  # a weight that is a strided view (a shard) runs through the BLAS
        wide = nn.Parameter(torch.randn(24, 80), requires_grad=False)
        lin.weight = nn.Parameter(wide[:, ::2], requires_grad=False)
        x = torch.randn(2, 40)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.weight = nn.Parameter(torch.randn(24, 40), requires_grad=False)  # and so does a strided bias
        lin.bias = nn.Parameter(torch.randn(48)[::2], requires_grad=False)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
    assert calls == [2, 6, 16, 6, 4]


def _native_everywhere(monkeypatch) -> nn.Linear:
    """A (24, 40) float32 layer planned to run every count 1..16 through the native kernel."""
    gemm_rows = _native_or_skip()
    monkeypatch.setattr(gemm_rows, "_time_rows", lambda *a, **k: 1e-3)  # (no need to time it)
    lin = nn.Linear(40, 24)
    plan_rows(lin)
    lin.row_plan = RowPlan((None,) * 16, (), (), (True,) * 16)
    return lin


def test_a_native_plan_runs_only_float32_products_of_the_weight_s_inner_size(monkeypatch):
    """The kernel reads x, the weight and the bias as float32 of the weight's shape: rows of
    another length are F.linear's error (not a read past x), and a layer whose dtype changed
    after planning, or a bias that is not one value per output, gets F.linear's values."""
    lin = _native_everywhere(monkeypatch)
    with torch.inference_mode():
        with pytest.raises(RuntimeError):  # 2 x 30 floats: the kernel read 2 x 40
            lin(torch.randn(2, 30))
        lin.bias = nn.Parameter(torch.randn(1), requires_grad=False)  # broadcast by F.linear
        x = torch.randn(3, 40)
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)
        lin.bias = nn.Parameter(torch.randn(24), requires_grad=False)
        lin.double()  # (to float16 the kernel wrote twice the output's bytes)
        x = x.double()
        torch.testing.assert_close(lin(x), F.linear(x, lin.weight, lin.bias), rtol=1e-5, atol=1e-5)


def test_a_native_plan_runs_only_on_the_cpu(monkeypatch):
    """A planned layer moved off the CPU (`.to`) hands the kernel no device addresses: it ran on
    the meta device's null pointers (a segmentation fault), and would on a GPU's."""
    lin = _native_everywhere(monkeypatch)
    lin.to("meta")
    with torch.inference_mode():
        y = lin(torch.empty(3, 40, device="meta"))
    assert y.device.type == "meta" and y.shape == (3, 24)


def test_a_planned_product_autograd_records_keeps_its_gradient(monkeypatch):
    """Frozen weights with an input or a bias that trains (bias-only fine-tuning): autograd
    records the product, so it runs plain and its gradients reach x and the bias."""
    lin = _native_everywhere(monkeypatch)
    lin.weight.requires_grad_(False)
    for x_grad, bias_grad in ((True, False), (False, True)):
        lin.bias.requires_grad_(bias_grad)
        lin.bias.grad = None
        x = torch.randn(3, 40, requires_grad=x_grad)
        lin(x).sum().backward()
        if x_grad:
            torch.testing.assert_close(x.grad, lin.weight.sum(0).expand(3, 40))
        else:
            torch.testing.assert_close(lin.bias.grad, torch.full((24,), 3.0))


def test_an_empty_weight_in_a_model_larger_than_the_cache_is_planned(monkeypatch):
    from hyrax.actors.model import gemm_rows

    monkeypatch.setattr(gemm_rows, "_time_rows", lambda *a, **k: 1e-3)
    monkeypatch.setattr(gemm_rows, "last_level_cache_bytes", lambda: 8 << 10)
    monkeypatch.setattr(gemm_rows, "_plans", {})
    assert gemm_rows._cold_copies(torch.zeros(0, 8)) == ()
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(0, 8), nn.Linear(8, 0))  # 16 KB: planned cold
    assert plan_rows(model) == 3


def test_the_native_kernel_runs_the_counts_where_it_beats_the_best_other_way():
    """At most 0.9 of the best other way at that count: MKL's (padded plans included) or
    oneDNN's where oneDNN won."""
    from hyrax.actors.model.gemm_rows import _plan_from

    mkl = _mkl_like()  # 10-15 rows best padded to 16 (1.7 ms)
    dnn = [0.85 * s for s in mkl[:9]] + [1.6e-3] * 7  # oneDNN: 1-9 rows
    native = [0.8 * s for s in mkl[:4]] + [0.85 * s for s in dnn[4:9]] + [1.55e-3] * 6 + [1.0e-3]
    plan = _plan_from({"mkl": mkl + [5e-3, 20e-3], "onednn": dnn + [4e-3, 18.5e-3], "native": native})
    # 1-4: 0.8 of MKL but 0.94 of oneDNN (which won there); 5-9: 0.85 of oneDNN; 10-15: 1.55 vs
    # MKL padded to 16, 1.7 (0.91); 16: 1.0 vs 1.7
    assert plan.native == (False,) * 4 + (True,) * 5 + (False,) * 6 + (True,)
    assert plan.onednn == (True,) * 9 + (False,) * 7  # oneDNN's own choice is unchanged
    assert [plan.native_for(m) for m in (0, 5, 16, 17, 64)] == [False, True, True, False, False]
    assert _plan_from({"mkl": mkl, "native": [1.0] * 16}) == RowPlan(best_pieces(mkl), native=(False,) * 16)


def test_a_native_kernel_that_differs_or_is_missing_gets_no_plan(monkeypatch):
    gemm_rows = _native_or_skip()
    w = torch.randn(64, 32)
    kernel = gemm_rows._NATIVE

    def off_by_one(x, w_, b, y, m, n, k):  # the first output one too large
        kernel(x, w_, b, y, m, n, k)
        ctypes.c_float.from_address(y).value += 1.0

    monkeypatch.setattr(gemm_rows, "_NATIVE", off_by_one)
    monkeypatch.setattr(gemm_rows, "_plans", {})
    assert not gemm_rows._native_serves(w, None)
    assert gemm_rows.row_plan(w, None).native == ()
    monkeypatch.setattr(gemm_rows, "_NATIVE", False)  # could not be built here
    monkeypatch.setattr(gemm_rows, "_plans", {})
    assert gemm_rows.row_plan(w, None).native == ()
    assert not gemm_rows._native_serves(torch.randn(64, 32, dtype=torch.float64), None)  # float32 only
    monkeypatch.setattr(gemm_rows, "_NATIVE", kernel)
    assert not gemm_rows._native_serves(torch.randn(32, 64).t(), None)  # a weight that is not contiguous


def test_a_model_larger_than_the_cache_is_planned_with_weights_out_of_it(monkeypatch):
    """Decode steps of a model whose linear weights exceed the last-level cache read every
    weight from memory; its plans are timed so (products cycling through copies spanning 1.5x
    the cache), a model that fits is timed with its weight in the cache."""
    from hyrax.actors.model import gemm_rows

    seen = []
    monkeypatch.setattr(gemm_rows, "_time_rows",
                        lambda w, b, m, product=F.linear, others=(): seen.append((w.shape, len(others))) or 1e-3)
    for llc, cold in ((1 << 20, False), (8 << 10, True)):
        monkeypatch.setattr(gemm_rows, "last_level_cache_bytes", lambda llc=llc: llc)
        monkeypatch.setattr(gemm_rows, "_plans", {})
        seen.clear()
        assert plan_rows(nn.Sequential(nn.Linear(64, 32), nn.Linear(32, 64))) == 2  # 16 KB of weights
        # 8 KB weights: 1.5 x 8 KB = 12 KB is the weight and one copy
        assert {n for _, n in seen} == ({1} if cold else {0})
    copies = gemm_rows._cold_copies(torch.zeros(10, 10))  # 400 bytes against 1.5 x 8 KB
    assert len(copies) == 30 and all(c.shape == (10, 10) for c in copies)
    assert len({c.data_ptr() for c in copies}) == 30
    assert gemm_rows._cold_copies(torch.zeros(64, 64)) == ()  # 16 KB: past the cache alone, no copy


def test_the_native_kernel_runs_past_16_rows_between_large_counts_it_won_at():
    """A decode step of 17-64 running requests: the kernel needs no padding, so a count between
    16 and 64 rows runs through it where it won at both (and past 64 where it won at 64 and
    256, past 256 where it won at 256); elsewhere the BLAS's way stands."""
    from hyrax.actors.model.gemm_rows import LARGE_ROWS, _plan_from

    mkl = _mkl_like()
    wins = [0.5 * s for s in mkl]
    plan = _plan_from({"mkl": mkl + [5e-3, 20e-3], "onednn": mkl + [4e-3, 18.5e-3], "native": wins + [3e-3, 19e-3]})
    assert LARGE_ROWS == (64, 256) and plan.native_large == (True, False)  # 3 vs oneDNN's 4; 19 vs 18.5
    assert [plan.native_for(m) for m in (16, 17, 40, 64, 65, 256, 300)] == [True] * 4 + [False] * 3
    assert [plan.onednn_for(m) for m in (64, 256)] == [True, True]  # (oneDNN's own choice unchanged)
    at_256 = _plan_from({"mkl": mkl + [5e-3, 20e-3], "native": wins + [3e-3, 10e-3]})  # no oneDNN: vs MKL
    assert at_256.native_large == (True, True) and all(at_256.native_for(m) for m in (17, 100, 256, 1000))
    lost_at_16 = _plan_from({"mkl": mkl + [5e-3, 20e-3], "native": wins[:15] + [mkl[15]] + [3e-3, 10e-3]})
    assert [lost_at_16.native_for(m) for m in (16, 17, 64, 65)] == [False, False, False, True]
    small = _plan_from({"mkl": mkl, "native": wins})  # a weight too small for the large counts
    assert small.native_large == () and not small.native_for(17)
