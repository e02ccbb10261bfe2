"""Prefix cache suite: what a cached prefix saves, and what the cache costs when nothing hits.

In-process engines on the demo checkpoint (full + sliding-window attention + Mamba2), the cache
on and off, same weights, same run:

- TTFT of requests that share a `prefix_len`-token prefix (a system prompt) after one request
  has cached it: cache off / cache on (target >= 5x faster);
- output tok/s of requests with unique prompts (0 % hit rate): cache on / off (target: costs at
  most 3 %, ratio >= 0.97).
"""
from __future__ import annotations

import random
import time

from bench.common import BENCH_SEED, Profile, demo_model_dir, median, progress
from bench.report import Row
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import load_engine
from hyrax.actors.engine.request import SamplingParams

OUT = 16


def _engine(cache: bool):
    return load_engine(demo_model_dir(), EngineConfig(prefix_cache=cache, kv_capacity_tokens=16384,
                                                      max_batch_tokens=2048, prefill_chunk=2048))


def _ttft(engine, prompt: list[int]) -> float:
    """Seconds from arrival to the first token of one request running alone."""
    t0 = time.perf_counter()
    rid = engine.add_request(prompt, SamplingParams(max_tokens=OUT))
    first = None
    while engine.has_unfinished() or engine.has_inflight():
        for o in engine.step():
            if o.req_id == rid and o.new_token_ids and first is None:
                first = time.perf_counter() - t0
    return first


def _throughput(engine, prompts: list[list[int]]) -> float:
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, SamplingParams(max_tokens=OUT, ignore_eos=True))
    n = 0
    while engine.has_unfinished() or engine.has_inflight():
        n += sum(len(o.new_token_ids) for o in engine.step())
    return n / (time.perf_counter() - t0)


def run(profile: Profile) -> list[Row]:
    rng = random.Random(BENCH_SEED)
    vocab = 200
    prefix = [rng.randrange(3, vocab) for _ in range(profile.prefix_len)]
    shared = [prefix + [rng.randrange(3, vocab) for _ in range(32)] for _ in range(profile.prefix_requests + 1)]
    unique = [[rng.randrange(3, vocab) for _ in range(rng.randrange(128, 512))]
              for _ in range(profile.prefix_unique_requests)]
    ttft, tps, hits = {}, {}, {}
    for cache in (False, True):
        progress(f"prefix: cache {'on' if cache else 'off'}, {profile.prefix_requests} requests sharing "
                 f"{profile.prefix_len} tokens")
        engine = _engine(cache)
        _ttft(engine, shared[0])  # warms up the engine, and (cache on) caches the prefix
        ttft[cache] = median(_ttft(engine, p) for p in shared[1:])
        hits[cache] = engine.stats.prefix.hit_tokens
        engine = _engine(cache)
        _throughput(engine, unique[:2])  # warm-up
        tps[cache] = _throughput(engine, unique)
    return [
        Row(f"prefix cache: TTFT ms with a shared {profile.prefix_len}-token prefix, on (baseline: off); ratio: x faster",
            ttft[True] * 1e3, ttft[False] * 1e3, ttft[False] / ttft[True], profile.target(">= 5")),
        Row("prefix cache: tokens a hit covered per request sharing the prefix", hits[True] / profile.prefix_requests,
            None, None),
        Row("prefix cache: output tok/s at 0 % hit rate, on / off", tps[True], tps[False], tps[True] / tps[False],
            profile.target(">= 0.97")),
    ]
