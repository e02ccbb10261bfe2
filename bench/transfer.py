"""Suite 4 — prefill→decode transfer, per request, in-process engines + the Ray object store.

A source engine (the prefill side) runs a request with an L-token prompt to its first token
and exports it (`Engine.export_running`: every component of the rank's shard gathered into one
byte buffer, a `StateShard`, and state-hashed per component, manifest); the hand-off goes through
the object store (`ray.put` + `ray.get`, as it does between the roles' actors: the buffer travels
out of band, unpickled); a destination engine imports it (`Engine.import_request`: new indices,
rows written, the written rows hashed and compared with the exporter's hashes) and the source
releases its indices. Both engines share one demo model (every
component kind), so the numbers are the state path alone.

Baseline, same run: `ray.put` + `ray.get` of one torch uint8 buffer of the same byte count,
timed right after each hand-off (interleaved, so that load from other processes on a shared
machine falls on both alike; the reported MB/s are medians, the ratio the median of the pairs').
Rows per prompt length: throughput of the whole hand-off vs that round trip (target >= 0.5),
and bytes moved vs `hyrax.actors.model.state.bytes_formula` summed over components
(target: exactly 1.0).
"""
from __future__ import annotations

import random
import time

import torch

from bench.common import BENCH_SEED, Profile, ensure_ray, load_demo_engine, median, progress, prompt_ids, run_until
from bench.report import Row, ratio


def _config():
    from hyrax.actors.engine.config import EngineConfig

    return EngineConfig(kv_capacity_tokens=16384, mamba_slots=8, max_running=8)


def _handoff_once(ray, src, dst, n: int, rng) -> tuple[float, int, int]:
    """One hand-off of a fresh n-token request: (seconds, bytes moved, formula bytes)."""
    from hyrax.actors.engine.request import SamplingParams
    from hyrax.actors.model.state import bytes_formula

    rid = src.add_request(prompt_ids(rng, n), SamplingParams(max_tokens=1000, ignore_eos=True))
    run_until(src, lambda: len(src.requests[rid].output_ids) >= 1)
    src.step_outputs_flush()
    t0 = time.perf_counter()
    handoff = src.export_running(rid)
    got = ray.get(ray.put(handoff))
    result = dst.import_request(got)
    src.release_handoff(rid)
    dt = time.perf_counter() - t0
    if result != "verified":
        raise RuntimeError(f"transfer: import of a {n}-token request gave {result!r}")
    m = handoff["manifest"]
    moved = sum(rec.bytes * len(rec.checksums) for rec in m.components.values())
    formula = sum(bytes_formula(src.components, m.num_tokens).values()) * m.num_ranks
    dst.abort(rid)
    dst.step_outputs_flush()
    return dt, moved, formula


def _put_get_seconds(ray, buf: torch.Tensor) -> float:
    """One `ray.put` + `ray.get` round trip of `buf`: seconds."""
    t0 = time.perf_counter()
    ray.get(ray.put(buf))
    return time.perf_counter() - t0


def run(profile: Profile) -> list[Row]:
    ray = ensure_ray()
    src = load_demo_engine(_config())
    dst = load_demo_engine(_config(), model=src.executor.rank.model)
    rng = random.Random(BENCH_SEED)
    _handoff_once(ray, src, dst, 32, rng)  # warm-up
    rows = []
    for n in profile.transfer_prompts:
        progress(f"transfer: export + object store + import, prompt {n}, {profile.transfer_reps} requests")
        runs, bases, buf = [], [], None
        for _ in range(profile.transfer_reps):
            runs.append(_handoff_once(ray, src, dst, n, rng))
            if buf is None:
                buf = torch.randint(0, 256, (runs[0][1],), dtype=torch.uint8)
                _put_get_seconds(ray, buf)  # the first round trip of this size warms the store up
            bases.append(_put_get_seconds(ray, buf))
        dt = median(r[0] for r in runs)
        moved, formula = runs[0][1], runs[0][2]
        if any(r[1] != moved for r in runs):
            raise RuntimeError("transfer: equal requests moved different byte counts")
        base = median(bases)
        mb = 1e6
        rows.append(Row(f"PD transfer, prompt {n}: hand-off MB/s vs ray.put+ray.get of one buffer",
                        moved / dt / mb, moved / base / mb, median(b / r[0] for b, r in zip(bases, runs)),
                        profile.target(">= 0.5")))
        rows.append(Row(f"PD transfer, prompt {n}: bytes per request vs bytes_formula", moved, formula,
                        ratio(moved, formula), "== 1"))
    for e in (src, dst):
        e.check_invariants()
        if not e.is_idle_clean():
            raise RuntimeError("transfer: an engine kept indices after the hand-offs")
    return rows
