"""Sampling cost: Hyrax's sampler (per-request seeded CDF inversion in float64, one host sync)
against plain `torch.multinomial` over the float32 softmax of the same logits, measured in
alternating rounds in the same process.

Every other bench drives greedy requests, so the cost of drawing at a temperature shows in no
other row; it grows with rows x vocabulary (a pass over (R, V) per operation), on the CPU the
dominant per-request cost of a non-greedy step of a small model.

Rows (informational), median seconds per call at 64 rows of an 8,192-token vocabulary:
- temperature 1: `sample()` (hyrax) vs multinomial (baseline);
- temperature 1 and top_p 0.9: `sample()` vs the usual sort-based nucleus filter (sort, cumulative
  sum, mask, scatter back, as transformers' TopPLogitsWarper does) followed by multinomial.
The logits are N(0, 3^2): nuclei of 121-614 of the 8,192 tokens (median 406) at top_p 0.9.
"""
from __future__ import annotations

from bench.common import BENCH_SEED, Profile, median, progress, time_call
from bench.report import Row

ROWS, VOCAB = 64, 8192
TOP_P = 0.9


def run(profile: Profile) -> list[Row]:
    import torch

    from hyrax.actors.engine.plan import SamplingSpec
    from hyrax.actors.engine.sampler import sample

    g = torch.Generator().manual_seed(BENCH_SEED)
    logits = torch.randn(ROWS, VOCAB, generator=g) * 3
    specs = [SamplingSpec(1.0, 1.0, 0, BENCH_SEED + k, 7) for k in range(ROWS)]
    nucleus_specs = [s._replace(top_p=TOP_P) for s in specs]

    def hyrax():
        sample(logits, specs)

    def baseline():
        torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=g).view(-1).tolist()

    def hyrax_top_p():
        sample(logits, nucleus_specs)

    def baseline_top_p():
        ordered, order = torch.sort(logits, dim=-1, descending=True)
        mass = torch.cumsum(torch.softmax(ordered, dim=-1), dim=-1)
        drop = mass > TOP_P
        drop[:, 1:] = drop[:, :-1].clone()  # keep the token that crosses top_p
        drop[:, 0] = False
        kept = torch.empty_like(logits).scatter_(1, order, ordered.masked_fill(drop, float("-inf")))
        torch.multinomial(torch.softmax(kept, dim=-1), 1, generator=g).view(-1).tolist()

    repeats = 20 if profile.judge_timing else 5
    rows = []
    for label, h_fn, b_fn, base in (("", hyrax, baseline, "torch.multinomial"),
                                    (f", top_p {TOP_P}", hyrax_top_p, baseline_top_p, "a sort-based top-p + multinomial")):
        sides: dict[str, list[float]] = {"hyrax": [], "baseline": []}
        for k in range(3):
            progress(f"sampling{label}: round {k + 1} of 3, {ROWS} rows x {VOCAB} tokens")
            sides["hyrax"].append(time_call(h_fn, repeats, warmup=0))
            sides["baseline"].append(time_call(b_fn, repeats, warmup=0))
        h, b = median(sides["hyrax"]), median(sides["baseline"])
        rows.append(Row(f"sampling: s per call, {ROWS} rows x {VOCAB} tokens at temperature 1{label} (seeded per "
                        f"request) vs {base}", h, b, h / b, ""))
    return rows
