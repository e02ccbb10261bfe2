"""The sampler draws every row of a batch in one vectorised pass (issue 21). What must hold:
the tokens follow the distribution temperature, top-k and top-p define (a chi-square test
against a direct per-row computation), never a token those filters remove, and a row's token
depends only on its own logits, seed and draw index — not on the batch around it."""
from __future__ import annotations

import math

import pytest
import torch

from hyrax.actors.engine.plan import SamplingSpec
from hyrax.actors.engine.sampler import sample, uniform

V = 12


def _logits(seed: int = 0) -> torch.Tensor:
    return torch.randn(V, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * 2


def _expected(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The distribution the definitions give, one row, written independently of the sampler."""
    x = logits / temperature
    if top_k:
        kth = sorted(x.tolist(), reverse=True)[top_k - 1]
        x = torch.where(x >= kth, x, torch.tensor(float("-inf"), dtype=x.dtype))
    p = torch.softmax(x, -1)
    order = sorted(range(V), key=lambda t: -p[t].item())
    keep, mass = set(), 0.0
    for t in order:  # smallest set, in order of probability, whose mass reaches top_p
        if mass >= top_p:
            break
        keep.add(t)
        mass += p[t].item()
    p = torch.tensor([p[t].item() if t in keep else 0.0 for t in range(V)], dtype=torch.float64)
    return p / p.sum()


def _draw(logits: torch.Tensor, n: int, temperature: float, top_k: int, top_p: float, seed0: int = 0) -> list[int]:
    specs = [SamplingSpec(temperature, top_p, top_k, seed0 + i, 0) for i in range(n)]
    return sample(logits.expand(n, V).clone(), specs)


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (1.0, 6, 0.9)])
def test_tokens_follow_the_filtered_distribution(temperature, top_k, top_p):
    logits = _logits(1)
    want = _expected(logits, temperature, top_k, top_p)
    n = 20_000
    got = torch.bincount(torch.tensor(_draw(logits, n, temperature, top_k, top_p)), minlength=V).double()
    assert all(got[t] == 0 for t in range(V) if want[t] == 0), (got, want)  # never a filtered token
    support = [t for t in range(V) if want[t] > 0]
    chi2 = sum((got[t] - n * want[t]) ** 2 / (n * want[t]) for t in support).item()
    dof = len(support) - 1
    # far beyond the 99.9th percentile of chi-square(dof) (about dof + 3.1 sqrt(2 dof) + 7)
    assert chi2 < dof + 5 * math.sqrt(2 * dof) + 10, (chi2, dof, got.tolist(), (n * want).tolist())


def test_a_rows_token_does_not_depend_on_its_batch():
    rows = [_logits(s) for s in range(6)]
    specs = [SamplingSpec(1.0, 0.9, 4, 100 + k, 7) for k in range(3)] + [SamplingSpec(0.8, 1.0, 0, 200 + k, 3) for k in range(2)] \
        + [SamplingSpec(0.0, 1.0, 0, 0, 0)]
    together = sample(torch.stack(rows), specs)
    alone = [sample(r.unsqueeze(0), [s])[0] for r, s in zip(rows, specs)]
    assert together == alone
    assert together[5] == int(torch.argmax(rows[5]))  # greedy row


def test_the_random_number_is_a_pure_function_of_seed_and_draw():
    u = [uniform(s, d) for s in (0, 1, 2**63 - 1) for d in (0, 1, 1000)]
    assert len(set(u)) == len(u) and all(0.0 <= x < 1.0 for x in u)
    assert uniform(5, 9) == uniform(5, 9)
    xs = [uniform(7, d) for d in range(20_000)]  # uniform over draws: mean and spread
    assert abs(sum(xs) / len(xs) - 0.5) < 0.01
    assert abs(sum((x - 0.5) ** 2 for x in xs) / len(xs) - 1 / 12) < 0.005


def test_degenerate_rows_take_the_most_likely_token():
    bad = torch.full((2, V), float("-inf"), dtype=torch.float64)
    bad[0, 3] = float("nan")
    bad[1, 4] = 0.0  # one finite token: the only choice
    toks = sample(bad, [SamplingSpec(1.0, 1.0, 0, 1, 0), SamplingSpec(1.0, 0.5, 3, 1, 0)])
    assert toks[1] == 4


@pytest.mark.parametrize("every_row_samples", [True, False])
def test_a_nan_or_infinite_logit_among_finite_ones_takes_the_most_likely_token(every_row_samples):
    """Softmax turns a row with a NaN or +inf logit into NaNs (and zeros): not a distribution to
    invert, whichever of its tokens the CDF search would land on. Such a row takes its argmax;
    the other rows draw as they would alone."""
    rows = [_logits(1), _logits(2), _logits(3)]
    rows[0][5] = float("inf")
    rows[1][2] = float("nan")
    specs = [SamplingSpec(1.0, 1.0, 0, 40 + k, 9) for k in range(3)]
    if not every_row_samples:  # a greedy row beside them: the sampled rows are a subset
        rows.append(_logits(4))
        specs.append(SamplingSpec(0.0, 1.0, 0, 0, 0))
    toks = sample(torch.stack(rows), specs)
    assert toks[0] == 5 and toks[1] == int(torch.argmax(rows[1]))
    assert toks[2] == sample(rows[2].unsqueeze(0), [specs[2]])[0]


def _nucleus_reference(row: torch.Tensor, top_p: float) -> torch.Tensor:
    """One row's kept tokens (bool), from the definition: the most likely tokens in order until
    their mass reaches top_p (at least one); every token tied with the last one kept too."""
    if top_p >= 1.0:
        return row > float("-inf")
    p = torch.softmax(row, -1).tolist()
    mass, floor = 0.0, None
    for t in sorted(range(len(p)), key=lambda t: -p[t]):
        if floor is not None and mass >= top_p:
            break
        floor, mass = row[t].item(), mass + p[t]
    return row >= floor


WIDE_V = 5000  # the CPU route looks among the most likely 625 tokens first


def _wide_rows() -> tuple[torch.Tensor, list[float]]:
    g = torch.Generator().manual_seed(9)
    base = torch.randn(8, WIDE_V, generator=g, dtype=torch.float64)
    rows = [base[0] * 4, base[1] * 4, base[2] * 0.1, base[3] * 1.5,  # peaked; flat; between
            torch.round(base[4] * 2) / 2, torch.round(base[5] * 3),  # many ties, at the floor too
            base[6], base[7] * 2, base[0]]
    rows[-1][7] = 100.0  # top_p 1 over a row whose first token's probability rounds to 1: still every token
    return torch.stack(rows), [0.5, 0.9, 0.9, 0.5, 0.9, 0.95, 1.0, 0.99, 1.0]


@pytest.mark.parametrize("top_k", [0, 300])
def test_the_nucleus_on_the_cpu_route_is_the_definitions(top_k):
    from hyrax.actors.engine.sampler import NUCLEUS_FIRST_MAX, NUCLEUS_FIRST_SHARE, RowFilters, filter_logits

    x, ps = _wide_rows()
    first = min(WIDE_V // NUCLEUS_FIRST_SHARE, NUCLEUS_FIRST_MAX)  # tokens the first look covers
    if top_k:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))  # as top-k leaves a row (tested above)
    f = RowFilters(torch.zeros(len(ps), dtype=torch.long), torch.tensor(ps, dtype=torch.float64), 0, True)
    got = filter_logits(x, f) > float("-inf")
    want = torch.stack([_nucleus_reference(r, p) for r, p in zip(x, ps)])
    assert torch.equal(got, want), [(k, int(got[k].sum()), int(want[k].sum())) for k in range(len(ps))]
    sizes = want.sum(dim=-1).tolist()
    if not top_k:  # a nucleus decided at each stage and one only by the whole sort
        edges = [0, first, WIDE_V + 1]
        assert all(any(a < n <= b for n in sizes) for a, b in zip(edges, edges[1:])), sizes
    # and each row as it is alone: what else is in the batch decides nothing
    for k in range(len(ps)):
        alone = RowFilters(torch.zeros(1, dtype=torch.long), torch.tensor(ps[k:k + 1], dtype=torch.float64), 0, True)
        assert torch.equal(filter_logits(x[k:k + 1], alone) > float("-inf"), want[k:k + 1]), k


@pytest.mark.parametrize("read_back", [True, False], ids=["cpu_route", "gpu_route"])
def test_a_draw_at_the_very_end_of_the_cdf_takes_the_last_token_with_mass(monkeypatch, read_back):
    """u * total can round up to the total: the search then runs past the row's end, and the
    token is the last one with mass (not the last of the vocabulary, which has none here)."""
    from hyrax.actors.engine import sampler as sampler_module
    from hyrax.actors.engine.sampler import draw_tokens

    monkeypatch.setattr(sampler_module, "READ_BACK_ON_CPU", read_back)
    x = torch.stack([_logits(5), _logits(6)])
    x[0, 9:] = float("-inf")  # tokens 9.. have no mass
    x[1, 4:] = float("-inf")
    ones = torch.ones(2, dtype=torch.float64)
    tok, ok = draw_tokens(x, ones, torch.tensor([1.0, 1.0], dtype=torch.float64))  # u at the very end
    assert tok.tolist() == [8, 3] and ok.all()
    tok, _ = draw_tokens(x, ones, torch.tensor([0.0, 1.0], dtype=torch.float64))  # one row only
    assert tok.tolist() == [0, 3]


def test_rows_with_top_p_1_never_send_the_batch_to_a_sort(monkeypatch):
    """Beside a row with top_p < 1, a top_p = 1 row's nucleus is its whole row: looking for it
    past the first look would sort rows only to leave them as they are."""
    from hyrax.actors.engine import sampler as sampler_module
    from hyrax.actors.engine.sampler import NUCLEUS_FIRST_MAX, NUCLEUS_FIRST_SHARE, RowFilters, filter_logits

    looked = []
    inner = sampler_module._nucleus_floor

    def recording(x, top_p, k):
        looked.append((x.shape[0], k))
        return inner(x, top_p, k)
    monkeypatch.setattr(sampler_module, "_nucleus_floor", recording)
    x, _ = _wide_rows()
    x = x[:2] * 4  # peaked rows: a nucleus of a few tokens at top_p 0.5
    f = RowFilters(torch.zeros(2, dtype=torch.long), torch.tensor([0.5, 1.0], dtype=torch.float64), 0, True)
    kept = filter_logits(x, f) > float("-inf")
    assert kept[1].all() and 0 < int(kept[0].sum()) < 10
    assert looked == [(2, min(WIDE_V // NUCLEUS_FIRST_SHARE, NUCLEUS_FIRST_MAX))], looked  # the first look only, no whole-row sort


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("shape", [(1, 264), (7, 264), (8, 256), (64, 264), (3, 8192), (0, 300)])
def test_row_argmax_is_torchs_argmax_with_ties_nan_and_infinities(dtype, shape):
    """The greedy pick (`row_argmax`: numpy's argmax on the CPU from NUMPY_ARGMAX_FROM elements,
    torch's below and for bfloat16) answers exactly what torch.argmax answers: the first of tied
    maxima, the first NaN, the first +inf; on contiguous and strided logits."""
    from hyrax.actors.engine.sampler import NUMPY_ARGMAX_FROM, row_argmax

    g = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randint(-3, 4, shape, generator=g).to(dtype)  # few distinct values: ties in every row
    if shape[0] >= 3:
        x[1, shape[1] // 3] = float("nan")
        x[1, shape[1] // 2] = float("nan")
        x[2, 5] = float("inf")
        x[2, 9] = float("inf")
    want = torch.argmax(x, dim=-1)
    got = row_argmax(x)
    assert got.dtype == torch.int64 and got.tolist() == want.tolist()
    wide = torch.cat([x, x], dim=1)[:, 1:shape[1] + 1]  # a strided view
    assert row_argmax(wide).tolist() == torch.argmax(wide, dim=-1).tolist()
    assert (x.numel() >= NUMPY_ARGMAX_FROM) == (shape[0] * shape[1] >= NUMPY_ARGMAX_FROM)
