"""Token sampling: greedy, temperature, top-k, top-p; seeded per request and per draw.

The random stream of a request is a pure function of (seed, draw index), so its output does
not depend on what else is in the batch, nor on retraction, transfer or migration.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from hyrax.actors.engine.plan import SamplingSpec


GREEDY_BELOW = 1e-5  # temperatures below this sample greedily


def _generator(seed: int, draw: int) -> torch.Generator:
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + draw * 7919 + 17) % (2**63 - 1))
    return g


def filter_logits(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: (V,) float. Returns logits with tokens outside top-k / nucleus set to -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # drop a token when the mass before it already reaches top_p (always keep the first)
        drop = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    return logits


def process_logits(logits: torch.Tensor, specs: list[SamplingSpec], histories: list[Sequence[int] | None],
                   eos: tuple[int, ...] = ()) -> torch.Tensor:
    """logits: (B, V). Returns (B, V) float64 with every row's LogitProcessing applied, in
    one vectorised pass over the R rows that have one, in vLLM's order:

    1. logit_bias: logit[t] += bias[t];
    2. min_tokens: while draw < min_tokens, stop_token_ids (and EOS unless ignore_eos) -> -inf;
    3. repetition_penalty r on every token of prompt + output: logit / r if > 0 else logit * r;
    4. frequency f and presence p on output tokens: logit -= f * count + p * (count > 0).

    histories[i]: the request's prompt + output ids (placeholders resolved; any int sequence,
    an int64 array is cheapest) for rows with a LogitProcessing, else None; its last
    `spec.draw` ids are the outputs.
    """
    x = logits.double()
    rows = [i for i, s in enumerate(specs) if s.process is not None]
    if not rows:
        return x
    V, dev = x.shape[1], x.device
    procs = [specs[i].process for i in rows]
    hs = [np.asarray(histories[i], dtype=np.int64) for i in rows]
    outs = [h[len(h) - specs[i].draw:] for h, i in zip(hs, rows)]

    def counts(per_row: list[np.ndarray]) -> torch.Tensor:
        """(R, V) occurrences of each token in each row's ids: one bincount over row * V + id."""
        flat = np.concatenate([k * V + ids for k, ids in enumerate(per_row)])
        return torch.bincount(torch.from_numpy(flat).to(dev), minlength=len(rows) * V).view(len(rows), V)

    def tensor(v: list, dtype=torch.long) -> torch.Tensor:
        return torch.tensor(v, dtype=dtype, device=dev)

    def col(v: list[float]) -> torch.Tensor:  # (R, 1) per-row scalars
        return tensor(v, x.dtype).unsqueeze(1)

    banned = [sorted(set(p.suppress) | (set() if p.ignore_eos else set(eos))) if specs[i].draw < p.min_tokens else []
              for p, i in zip(procs, rows)]
    sub = x[tensor(rows)]  # (R, V)
    sub.index_put_((tensor([k for k, p in enumerate(procs) for _ in p.bias]), tensor([t for p in procs for t, _ in p.bias])),
                   tensor([b for p in procs for _, b in p.bias], x.dtype), accumulate=True)
    sub.index_put_((tensor([k for k, ts in enumerate(banned) for _ in ts]), tensor([t for ts in banned for t in ts])),
                   tensor(float("-inf"), x.dtype))
    rep = col([p.repetition for p in procs])
    sub = torch.where(counts(hs) > 0, torch.where(sub > 0, sub / rep, sub * rep), sub)
    out = counts(outs).to(x.dtype)
    sub = sub - col([p.frequency for p in procs]) * out - col([p.presence for p in procs]) * (out > 0).to(x.dtype)
    x[tensor(rows)] = sub
    return x


def sample(logits: torch.Tensor, specs: list[SamplingSpec], histories: list[Sequence[int] | None] | None = None,
           eos: tuple[int, ...] = (), allowed: torch.Tensor | None = None) -> list[int]:
    """logits: (B, V) for the rows that sample; histories as `process_logits` takes them
    (needed only when some spec has a LogitProcessing); allowed: (B, V) bool, the tokens each
    row's grammar allows (structured output), applied after the logit processing and before
    temperature and filtering. One host sync for the batch."""
    if not specs:
        return []
    logits = process_logits(logits, specs, histories or [None] * len(specs), eos)
    if allowed is not None:
        logits = logits.masked_fill(~allowed.to(logits.device), float("-inf"))
    out = torch.argmax(logits, dim=-1)
    for i, s in enumerate(specs):
        if s.temperature < GREEDY_BELOW:
            continue  # greedy: also for temperatures so small the division would overflow
        row = filter_logits(logits[i] / s.temperature, s.top_k, s.top_p)
        probs = torch.softmax(row, dim=-1)
        if not bool(torch.isfinite(probs).all()) or float(probs.sum()) <= 0.0:
            continue  # degenerate distribution: the most likely token
        out[i] = torch.multinomial(probs.cpu(), 1, generator=_generator(s.seed, s.draw))[0]
    return out.tolist()


def logprobs_of(logits: torch.Tensor, tokens: list[int], specs: list[SamplingSpec]) -> dict[int, dict]:
    """For rows whose spec asks: {row: {"logprob": float, "top": [[token, logprob], ...]}},
    from the model's distribution (before temperature and filtering, as vLLM reports)."""
    out: dict[int, dict] = {}
    for i, s in enumerate(specs):
        if s.logprobs is None:
            continue
        lp = torch.log_softmax(logits[i].double(), dim=-1)
        top = torch.topk(lp, s.logprobs) if s.logprobs else None
        out[i] = {"logprob": float(lp[tokens[i]]),
                  "top": [[int(t), float(v)] for v, t in zip(top.values, top.indices)] if top else []}
    return out
