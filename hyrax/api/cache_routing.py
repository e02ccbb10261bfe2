"""Cache-aware routing of a request's first hop (prefill replicas, or colocated ones).

Each candidate replica is asked how many leading prompt tokens its prefix cache would cover
(`CachedPrefix`, read-only); the request goes to the replica with the longest cached prefix,
unless that replica has more than `margin` requests in flight beyond the least-loaded one (then,
or when no replica has any of the prompt cached, to the least-loaded one). Every decision and the
hit length it bought are counted for /metrics.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from hyrax.actors.engine.commands import CachedPrefix

ASK_TIMEOUT_S = 2.0


@dataclass
class RouteStats:
    decisions: Counter = field(default_factory=Counter)  # "cache" | "load" (no hit) | "margin" (hit, too busy)
    routed_hit_tokens: int = 0  # cached prompt tokens on the replicas chosen
    best_hit_tokens: int = 0  # the longest cached prefix among the candidates, summed
    # refusals at admission (a closed replica): "rerouted" to another replica, "answered" (503: none left)
    refusals: Counter = field(default_factory=Counter)


async def pick_by_prefix(cands: list, inflight: dict[int, int], least_loaded: Callable, prompt_ids: list[int],
                         margin: int, stats: RouteStats):
    ask = tuple(prompt_ids)
    answers = await asyncio.gather(*(asyncio.wait_for(b.run(CachedPrefix(ask)), ASK_TIMEOUT_S) for b in cands),
                                   return_exceptions=True)  # a replica that cannot answer counts as no hit
    # load as it is now, after the wait: requests routed meanwhile are counted (the caller takes
    # ownership with no await in between), so a burst does not all see the same idle replica
    least = least_loaded(cands, inflight)
    lengths = [a if isinstance(a, int) and not isinstance(a, bool) else 0 for a in answers]
    best_len = max(lengths)
    stats.best_hit_tokens += best_len
    if best_len == 0:
        stats.decisions["load"] += 1
        return least
    best = min((b for b, n in zip(cands, lengths) if n == best_len), key=lambda b: (inflight.get(id(b), 0), b.index))
    if inflight.get(id(best), 0) - inflight.get(id(least), 0) > margin:
        stats.decisions["margin"] += 1
        stats.routed_hit_tokens += lengths[cands.index(least)]
        return least
    stats.decisions["cache"] += 1
    stats.routed_hit_tokens += best_len
    return best
