"""Which form the SSD decode step's readout takes on this CPU, measured once per state shape.

The readout y = S . C contracts each (sequence, group) pair's state S (R*P, N) with its C (N):
as a batched matrix-vector product S @ C, or transposed, (C^T @ S^T)^T. Both are one `bmm`
over the same bytes, and which of the two the BLAS runs faster is a property of the CPU, not
of the code: on the 2-core VM's AMD EPYC with AVX-512 (torch 2.13, MKL, one thread), 32 pairs of
(256, 32) took 250-460 us plain and 43-68 us transposed (5-7x); an earlier session measured
the opposite order (62 vs 345 us at 16 pairs) on what was most likely another host CPU, and
the code had already flipped between the two forms twice on such measurements.

So each state shape is timed both ways at two pair counts the first time a model with it is
loaded (a few ms), and the transposed form is used only where it is clearly cheaper at both
(`MARGIN`, as row plans: near-ties keep the plain product and its rounding). Like row plans,
this is per process, so deterministic mode, which needs every process to compute alike,
keeps the plain form (loader.py's `row_plans`). A single pair (one sequence, one group) is
always plain.
"""
from __future__ import annotations

import time

import torch
from torch import nn

MARGIN = 0.8  # the transposed form is used only if it costs at most this share of the plain one
PAIRS = (8, 32)  # pair counts timed
_plans: dict[tuple, bool] = {}


def _seconds(fn, reps: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def transposed_is_faster(rows: int, n: int, dtype: torch.dtype) -> bool:
    """Whether (C^T @ S^T)^T beats S @ C clearly, at every timed pair count, for states of
    (rows, n) in `dtype` on this CPU (measured the first time, then remembered)."""
    key = (rows, n, dtype)
    if key not in _plans:
        faster = True
        with torch.inference_mode():
            for pairs in PAIRS:
                s = torch.randn(pairs, rows, n).to(dtype)
                c = torch.randn(pairs, n, 1).to(dtype)
                plain = _seconds(lambda: torch.bmm(s, c))
                flipped = _seconds(lambda: torch.bmm(c.transpose(1, 2), s.transpose(1, 2)))
                faster = faster and flipped <= MARGIN * plain
        _plans[key] = faster
    return _plans[key]


def plan_readouts(model: nn.Module) -> int:
    """Give every CPU Mamba2 layer of `model` the readout form its state shape runs fastest
    here; returns how many layers take the transposed form."""
    from hyrax.actors.model.mamba2 import Mamba2Mixer
    from hyrax.actors.model.components import ssm_dtype

    n = 0
    for m in model.modules():
        if isinstance(m, Mamba2Mixer) and m.in_proj.weight.device.type == "cpu":
            rows = (m.nh // m.n_groups_local) * m.cfg.mamba_d_head
            m.readout_transposed = transposed_is_faster(rows, m.cfg.mamba_d_state, ssm_dtype(m.in_proj.weight.dtype))
            n += m.readout_transposed
    return n
