"""Token sampling: greedy, temperature, top-k, top-p; seeded per request and per draw.

The random stream of a request is a pure function of (seed, draw index), so its output does
not depend on what else is in the batch, nor on retraction, transfer or migration.
"""
from __future__ import annotations

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


def sample(logits: torch.Tensor, specs: list[SamplingSpec]) -> list[int]:
    """logits: (B, V) for the rows that sample. One host sync for the batch."""
    if not specs:
        return []
    out = torch.argmax(logits, dim=-1)
    for i, s in enumerate(specs):
        if s.temperature < GREEDY_BELOW:
            continue  # greedy: also for temperatures so small the division would overflow
        row = filter_logits(logits[i].double() / s.temperature, s.top_k, s.top_p)
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
