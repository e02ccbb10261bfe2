"""Captured decode steps (issue 21): the decode forward through torch.compile vs eager.

One in-process engine on the demo checkpoint with `captured_decode="compile"`, 16 requests
decoding; one of its real decode batches (T == 1, B = 16) is run through the model's eager
forward and its compiled one, interleaved (the machine is shared: medians of rounds), on the
engine's own pools (both write the same rows). The compile itself (the first call) is a row
of its own: it is start-up time a `--captured-decode compile` replica pays once.

In the default suites since the compile takes seconds (~9 s; the suite ~40 s on 2 cores); it
was run only when named while the compile took minutes.
"""
from __future__ import annotations

import random
import time

from bench.common import BENCH_SEED, Profile, load_demo_engine, median, progress, prompt_ids, run_until
from bench.report import Row

BATCH = 16
PROMPT = 200


def _decode_batch(engine):
    """A real decode batch of the engine (every request running, past its first tokens): the
    one the next step hands the model, run eagerly, with the pools it was run on."""
    rank = engine.executor.rank
    model = rank.model
    captured = model.forward  # CapturedDecode
    seen = []

    def record(batch, pools, all_logits=False):
        seen.append(batch)
        return captured.eager(batch, pools, all_logits)
    model.forward = record
    try:
        engine.step()
    finally:
        model.forward = captured
    if not seen or seen[-1].num_seqs != BATCH or seen[-1].max_len != 1:
        raise RuntimeError("captured bench: the step was not a decode step of the whole batch")
    return seen[-1], rank.pools


def run(profile: Profile) -> list[Row]:
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.request import SamplingParams

    engine = load_demo_engine(EngineConfig(kv_capacity_tokens=65536, mamba_slots=BATCH + 4, max_running=BATCH,
                                           captured_decode="compile", prefix_cache=False))
    rng = random.Random(BENCH_SEED)
    ids = [engine.add_request(prompt_ids(rng, PROMPT), SamplingParams(max_tokens=10_000, ignore_eos=True))
           for _ in range(BATCH)]
    run_until(engine, lambda: all(len(engine.requests[i].output_ids) >= 2 for i in ids))
    model = engine.executor.rank.model
    captured = model.forward  # CapturedDecode
    batch, pools = _decode_batch(engine)
    progress(f"captured: compiling the decode forward (B={BATCH})")
    t0 = time.perf_counter()
    captured.decode(batch, pools)
    compile_s = time.perf_counter() - t0
    calls = {"eager": lambda: captured.eager(batch, pools), "compiled": lambda: captured.decode(batch, pools)}
    rounds = max(5, profile.coord_steps // 3)
    ms = {k: [] for k in calls}
    for _ in range(rounds):
        for k, call in calls.items():
            t = time.perf_counter()
            for _ in range(5):
                call()
            ms[k].append((time.perf_counter() - t) / 5 * 1e3)
    eager, compiled = median(ms["eager"]), median(ms["compiled"])
    return [
        Row(f"captured decode: demo decode forward ms at batch {BATCH}, torch.compile vs eager (ratio: eager/compiled, "
            f"the speed-up)", compiled, eager, eager / compiled, profile.target(">= 1.3")),
        Row("captured decode: seconds to compile the decode forward (first call; start-up a replica pays once)",
            compile_s, None, None),
    ]
