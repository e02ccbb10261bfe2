"""Token sampling: greedy, temperature, top-k, top-p; seeded per request and per draw; one
vectorised pass for the whole batch and one host sync (the tokens).

A row draws its token by inverting its distribution's CDF at one uniform number, which is a
pure function of (seed, draw index): its output does not depend on what else is in the
batch, nor on retraction, transfer or migration.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch

from hyrax.actors.engine.plan import SamplingSpec
from hyrax.actors.engine.spec_columns import MASK64, SpecColumns
from hyrax.actors.model.batch import upload


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


def uniform(seed: int, draw: int) -> float:
    """The request's random number for output `draw`, in [0, 1): a pure function of
    (seed, draw), 53 bits, whatever else is in the batch."""
    return (_splitmix64(_splitmix64(seed & MASK64) ^ (draw & MASK64)) >> 11) * 2.0**-53


_U64 = np.uint64


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """`_splitmix64` of each element of a uint64 array (numpy's uint64 arithmetic wraps)."""
    x = x + _U64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> _U64(30))) * _U64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> _U64(27))) * _U64(0x94D049BB133111EB)
    return x ^ (x >> _U64(31))


# below this many rows the scalar function is cheaper than numpy's fixed cost per operation
UNIFORMS_SCALAR_BELOW = 12


def uniforms(seeds: np.ndarray, draws: np.ndarray) -> np.ndarray | list[float]:
    """`uniform(seed, draw)` of each row: seeds uint64 (R,), draws int64 (R,) >= 0; a float64
    array, or (below UNIFORMS_SCALAR_BELOW rows) a list of floats."""
    if len(seeds) < UNIFORMS_SCALAR_BELOW:
        return list(map(uniform, seeds.tolist(), draws.tolist()))
    with np.errstate(over="ignore"):
        bits = _splitmix64_array(_splitmix64_array(seeds.astype(_U64, copy=False)) ^ draws.astype(_U64)) >> _U64(11)
    return bits.astype(np.float64) * 2.0**-53


@dataclass(frozen=True)
class RowFilters:
    """Each sampled row's top-k and top-p on the device, with what the host knows of them."""

    top_k: torch.Tensor  # (R,) long, 0: off (also where k >= vocab)
    top_p: torch.Tensor  # (R,) float, 1: off
    k_max: int  # the largest top_k, 0 when no row keeps a top-k
    p_any: bool  # some row's top_p < 1

    @property
    def active(self) -> bool:
        return bool(self.k_max) or self.p_any


# On the CPU a row's nucleus is first looked for among its most likely V / NUCLEUS_FIRST_SHARE
# tokens (at most NUCLEUS_FIRST_MAX, at least 64; one `topk`: 1,024 of 8,192 float64 logits cost
# about a sixth of a sort), and only the rows whose nucleus reaches past them are sorted whole
# (a row of nearly flat probabilities then costs ~35 % more than a sort alone). On a GPU every
# row is sorted (cheap there, and no host read to decide).
NUCLEUS_FIRST_SHARE, NUCLEUS_FIRST_MAX = 8, 1024

# On a CPU device the sampler reads small answers back to skip work (which rows need a sort,
# whether a draw ran past the end): there it costs nothing. tests/unit/test_host_syncs.py turns
# this off to count the GPU route's host waits on the CPU.
READ_BACK_ON_CPU = True


def _reads_are_free(t: torch.Tensor) -> bool:
    return t.device.type == "cpu" and READ_BACK_ON_CPU


_NUMPY_ARGMAX = (torch.float32, torch.float64)
NUMPY_ARGMAX_FROM = 2048  # elements: below, torch's fixed cost is the smaller (1.9 vs 3.3 us at 1 x 264)


def row_argmax(x: torch.Tensor) -> torch.Tensor:
    """(B, V) -> (B,) int64: each row's first largest value's index (a NaN counts as largest), as
    `torch.argmax(x, dim=-1)`. On the CPU, from NUMPY_ARGMAX_FROM elements, through numpy's
    argmax: the same answer, 3-13x faster on one thread (torch's CPU kernel takes ~0.8 ns an
    element: 16 vs 5 us at 64 x 264, 476 vs 36 us at 64 x 8,192, measured); elsewhere (and for
    dtypes numpy lacks) torch's."""
    if x.numel() >= NUMPY_ARGMAX_FROM and x.device.type == "cpu" and x.dtype in _NUMPY_ARGMAX:
        return torch.from_numpy(np.argmax(x.numpy(), axis=-1))
    return torch.argmax(x, dim=-1)


def filter_logits(logits: torch.Tensor, f: RowFilters) -> torch.Tensor:
    """logits: (R, V) float. Returns the logits with the tokens outside each row's top-k
    (every token tied with the k-th value kept) and then outside its nucleus set to -inf.
    Both are thresholds on the logit: top-k's is the k-th largest value; top-p's is the value
    of the last token of the nucleus (the shortest run of most likely tokens whose mass reaches
    top_p, at least one), and every token tied with it is kept as well, so the result does not
    depend on how a sort orders ties. A row with top_p >= 1 is left as it is. Top-k needs no
    sort; on a GPU no host sync (on the CPU one, for the rows whose nucleus needs a sort)."""
    x = logits
    if f.k_max:
        top = torch.topk(x, f.k_max, dim=-1).values  # (R, kmax), descending
        kth = top.gather(1, (f.top_k - 1).clamp(min=0).unsqueeze(1))
        kth = kth.masked_fill((f.top_k == 0).unsqueeze(1), float("-inf"))
        x = x.masked_fill(x < kth, float("-inf"))
    if not f.p_any:
        return x
    top_p = f.top_p.to(x.dtype)
    V = x.shape[-1]
    first = min(V // NUCLEUS_FIRST_SHARE, NUCLEUS_FIRST_MAX) if _reads_are_free(x) else V
    first = first if first >= 64 else V
    floor, inside = _nucleus_floor(x, top_p, first)
    off = top_p >= 1.0  # rows left as they are (a batch where another row has top_p < 1)
    if first < V:
        inside |= off  # their nucleus is the whole row: never worth a sort
        wide = torch.nonzero(~inside).view(-1)  # the host read: rows whose nucleus is wider
        if len(wide):
            floor[wide] = _nucleus_floor(x[wide], top_p[wide], V)[0]
    return x.masked_fill(x < floor.masked_fill(off.unsqueeze(1), float("-inf")), float("-inf"))


def _nucleus_floor(x: torch.Tensor, top_p: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From each row's k most likely tokens (all V: a full sort): (n, 1) the logit of the last
    token of the row's nucleus, and (n,) whether the nucleus ends among those k (always, when
    k == V). Mass is relative to the whole row. A token is in the nucleus while the mass of the
    tokens before it is < top_p: the running sum never decreases, so those before the first
    sum to reach top_p, and that one."""
    V = x.shape[-1]
    if k < V:
        vals = torch.topk(x, k, dim=-1).values
        probs = torch.exp(vals - torch.logsumexp(x, dim=-1, keepdim=True))
    else:
        vals = torch.sort(x, dim=-1, descending=True).values
        probs = torch.softmax(vals, dim=-1)
    below = (torch.cumsum(probs, dim=-1) < top_p.unsqueeze(1)).sum(dim=-1)  # (n,) sums short of top_p
    n = (below + 1).clamp(max=k)
    return vals.gather(1, (n - 1).unsqueeze(1)), (below < k) | (k == V)


def draw_tokens(logits: torch.Tensor, temperature: torch.Tensor, u: torch.Tensor,
                filters: RowFilters | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(R, V) logits -> (R,) tokens drawn by inverting each row's CDF (in token-id order) at
    its `u` (R,) after temperature, top-k and top-p (None: no row filters), and (R,)
    whether the row's distribution was usable (finite and not empty; the caller takes the
    most likely token for the others). No host sync on a GPU."""
    V = logits.shape[-1]
    x = logits / temperature.unsqueeze(1).double()  # float64 from here on, whatever the logits' dtype
    if filters is not None and filters.active:
        x = filter_logits(x, filters)
    probs = torch.softmax(x, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1:]
    # usable: some mass, and no NaN (softmax gives values in [0, 1] or NaN, and a NaN anywhere in
    # a row reaches its cumulative sum's end, where `> 0` is False): one (R,) check, not (R, V)
    ok = total[:, 0] > 0
    pos = torch.searchsorted(cdf, u.unsqueeze(1).to(cdf.dtype) * total, right=True)
    # a token without mass is never found (its running sum equals the one before it), but
    # rounding can put u * total at the very end (pos == V): take the last token with mass. On
    # the CPU that is looked for only when it happened (reading the answer costs nothing there).
    if not _reads_are_free(x) or bool((pos >= V).any()):
        last = V - 1 - torch.argmax((probs > 0).flip(-1).to(torch.int8), dim=-1, keepdim=True)
        pos = torch.minimum(pos, last)
    return pos[:, 0], ok


def process_logits(logits: torch.Tensor, specs: list[SamplingSpec], histories: list[Sequence[int] | None],
                   eos: tuple[int, ...] = ()) -> torch.Tensor:
    """logits: (B, V). Returns (B, V) float64 with every row's LogitProcessing applied, in
    one vectorised pass over the R rows that have one, in vLLM's order (no row has one: the
    logits as they are, not copied; the sampler's float64 columns promote them where it divides):

    1. logit_bias: logit[t] += bias[t];
    2. min_tokens: while draw < min_tokens, stop_token_ids (and EOS unless ignore_eos) -> -inf;
    3. repetition_penalty r on every token of prompt + output: logit / r if > 0 else logit * r;
    4. frequency f and presence p on output tokens: logit -= f * count + p * (count > 0).

    histories[i]: the request's prompt + output ids (placeholders resolved; any int sequence,
    an int64 array is cheapest) for rows with a LogitProcessing, else None; its last
    `spec.draw` ids are the outputs.
    """
    rows = [i for i, s in enumerate(specs) if s.process is not None]
    return _processed(logits, rows, [specs[i] for i in rows], [histories[i] for i in rows], eos)


def _processed(logits: torch.Tensor, rows: list[int], specs: list[SamplingSpec], histories: list[Sequence[int]],
               eos: tuple[int, ...]) -> torch.Tensor:
    """`process_logits` for the rows `rows` only, with their specs and histories (in that order)."""
    if not rows:
        return logits
    # a copy, also of float64 logits: the caller's stay the model's (logprobs are reported from them)
    x = logits.double()
    if x is logits:
        x = x.clone()  # float64 already: a copy all the same
    R, V, dev = len(rows), x.shape[1], x.device
    procs = [s.process for s in specs]
    hs = [np.asarray(h, dtype=np.int64) for h in histories]
    outs = [h[len(h) - s.draw:] for h, s in zip(hs, specs)]
    banned = [sorted(set(p.suppress) | (set() if p.ignore_eos else set(eos))) if s.draw < p.min_tokens else []
              for p, s in zip(procs, specs)]
    # every number the processing needs, in one float64 host array (ids and counts are exact
    # there), moved in one copy; positions in the (R, V) rows are flattened to k * V + token
    host = {
        "rows": rows, "repetition": [p.repetition for p in procs], "frequency": [p.frequency for p in procs],
        "presence": [p.presence for p in procs],
        "bias_at": [k * V + t for k, p in enumerate(procs) for t, _ in p.bias], "bias": [b for p in procs for _, b in p.bias],
        "banned_at": [k * V + t for k, ts in enumerate(banned) for t in ts],
        "seen_at": np.concatenate([k * V + ids for k, ids in enumerate(hs)]),
        "out_at": np.concatenate([k * V + ids for k, ids in enumerate(outs)]),
    }
    parts = [np.asarray(v, dtype=np.float64) for v in host.values()]
    moved = upload(torch.from_numpy(np.concatenate(parts)), dev)
    d = dict(zip(host, moved.split([len(v) for v in parts])))

    def counts(at: torch.Tensor) -> torch.Tensor:
        """(R, V) occurrences of each token in each row: one index_add over row * V + id (a
        bincount would read its largest value back to size its output)."""
        return torch.zeros(R * V, dtype=x.dtype, device=dev).index_add_(
            0, at.long(), torch.ones(at.shape[0], dtype=x.dtype, device=dev)).view(R, V)

    idx = d["rows"].long()
    flat = x.index_select(0, idx).view(-1)  # (R * V,)
    flat.index_add_(0, d["bias_at"].long(), d["bias"])
    flat.index_fill_(0, d["banned_at"].long(), float("-inf"))
    sub = flat.view(R, V)
    rep = d["repetition"].unsqueeze(1)
    sub = torch.where(counts(d["seen_at"]) > 0, torch.where(sub > 0, sub / rep, sub * rep), sub)
    out = counts(d["out_at"])
    sub = sub - d["frequency"].unsqueeze(1) * out - d["presence"].unsqueeze(1) * (out > 0).to(x.dtype)
    return x.index_copy_(0, idx, sub)


def _min_p(logits: torch.Tensor, cols: SpecColumns, rows: list[int]) -> torch.Tensor:
    """logits: (B, V), a copy the processing made. In the rows among `rows` that sample with a
    min_p, sets to -inf every token less likely after temperature than min_p times the row's
    most likely one: p_t >= min_p * p_max <=> logit_t >= max logit + temperature * ln(min_p), a
    threshold on the logits as they are, so it runs before the temperature divides them (as
    vLLM's comes before top-k and top-p). Greedy rows are left alone (their argmax stays)."""
    at = [(k, s.temperature * math.log(s.process.min_p)) for k, s in ((k, cols.extra[k]) for k in rows)
          if s.process.min_p > 0 and s.temperature >= GREEDY_BELOW]
    if not at:
        return logits
    row, offset = upload(torch.from_numpy(np.array(at, dtype=np.float64).T.copy()), logits.device).unbind(0)  # (M,) each
    idx = row.long()
    sub = logits.index_select(0, idx)  # (M, V)
    floor = sub.max(dim=-1, keepdim=True).values + offset.to(sub.dtype).unsqueeze(1)
    return logits.index_copy_(0, idx, sub.masked_fill(sub < floor, float("-inf")))


def sample(logits: torch.Tensor, specs: Sequence[SamplingSpec] | SpecColumns,
           histories: list[Sequence[int] | None] | None = None, eos: tuple[int, ...] = (),
           allowed: torch.Tensor | None = None) -> list[int]:
    """logits: (B, V) for the rows that sample; `specs`: their SamplingSpecs, or the same as
    `SpecColumns` (what a rank passes: no per-row object for a decode block's rows);
    histories as `process_logits` takes them (needed only for rows with a LogitProcessing);
    allowed: (B, V) bool, the tokens each row's grammar allows (structured output), applied
    after the logit processing and before min_p, temperature and filtering. One host sync for the batch."""
    cols = specs if isinstance(specs, SpecColumns) else SpecColumns.of(specs)
    if not len(cols):
        return []
    processed = cols.processed_rows
    if processed:
        logits = _processed(logits, processed, [cols.extra[k] for k in processed],
                            [histories[k] for k in processed], eos)
    if allowed is not None:
        logits = logits.masked_fill(~upload(allowed, logits.device), float("-inf"))
    if processed:
        logits = _min_p(logits, cols, processed)
    out = row_argmax(logits)
    # greedy rows (also temperatures so small the division would overflow) keep the argmax;
    # decisions on Python lists (`tolist` is one C call, and numpy's fixed cost per operation
    # would exceed the per-row work at a few rows), the per-row numbers in arrays
    temps = cols.temperature.tolist()
    rows = [i for i, t in enumerate(temps) if t >= GREEDY_BELOW]
    if rows:
        V = logits.shape[-1]
        if len(rows) == len(temps):
            temperature, top_k, top_p, seeds, draws = cols.temperature, cols.top_k, cols.top_p, cols.seeds, cols.draws
        else:
            take = np.array(rows, dtype=np.int64)
            temperature, top_k, top_p, seeds, draws = (a[take] for a in (
                cols.temperature, cols.top_k, cols.top_p, cols.seeds, cols.draws))
        ks = [k if 0 < k < V else 0 for k in top_k.tolist()]
        ps = top_p.tolist()
        # one copy for every sampled row's parameters: row, temperature, uniform number, top-k
        # and top-p (float64 holds each exactly), one row each of a (5, R) array
        host = np.empty((5, len(rows)), dtype=np.float64)
        host[0], host[1], host[2], host[3], host[4] = rows, temperature, uniforms(seeds, draws), ks, ps
        row, temperature, u, top_k_t, top_p_t = upload(torch.from_numpy(host), logits.device).unbind(0)  # (R,) each
        filters = RowFilters(top_k_t.long(), top_p_t, max(ks), min(ps) < 1.0)
        if len(rows) == len(temps):  # every row samples: no copy of the logits, no scatter back
            tok, ok = draw_tokens(logits, temperature, u, filters)
            out = torch.where(ok, tok, out)  # a degenerate distribution: the most likely token
        else:
            idx = row.long()
            tok, ok = draw_tokens(logits[idx], temperature, u, filters)
            out[idx] = torch.where(ok, tok, out[idx])
    return out.tolist()


def logprobs_of(logits: torch.Tensor, tokens: list[int], specs: Sequence[SamplingSpec] | SpecColumns) -> dict[int, dict]:
    """For rows whose spec asks: {row: {"logprob": float, "top": [[token, logprob], ...]}},
    from the model's distribution (before temperature and filtering, as vLLM reports).
    logits: (B, V). One copy in (rows and tokens) and one host read for the batch."""
    asks = specs.logprobs if isinstance(specs, SpecColumns) else [s.logprobs for s in specs]
    rows = [i for i, n in enumerate(asks) if n is not None]
    if not rows:
        return {}
    k = max(asks[i] for i in rows)
    picked = np.array([rows, [tokens[i] for i in rows]], dtype=np.int64)
    idx, tok = upload(torch.from_numpy(picked), logits.device).unbind(0)  # (R,) each
    lp = torch.log_softmax(logits.index_select(0, idx).double(), dim=-1)  # (R, V)
    parts = [lp.gather(1, tok.unsqueeze(1))]  # (R, 1): the chosen tokens'
    if k:
        top = torch.topk(lp, k, dim=-1)  # (R, k) each, most likely first
        parts += [top.indices.double(), top.values]  # ids are exact in float64
    read = torch.cat(parts, dim=1).tolist()  # (R, 1 + 2k), the one read
    out: dict[int, dict] = {}
    for i, r in zip(rows, read):
        n = asks[i]
        out[i] = {"logprob": r[0], "top": [[int(t), v] for t, v in zip(r[1:1 + n], r[1 + k:1 + k + n])]}
    return out
