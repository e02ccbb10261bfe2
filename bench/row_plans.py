"""The large model's decode step with row-planned linear layers vs plain ones (one process).

`hyrax/actors/model/gemm_rows.py` runs a CPU product of few rows padded or split where the
BLAS runs that row count slowly, through oneDNN where its kernels are clearly faster, or through
Hyrax's own kernel for few rows (`kernels/gemm_rows.c`) where that beats both. A decode step has one row per running request; with 15
running (one short of MKL's 16-row kernel) the step's linear layers are where it shows.
Same engine, same requests, the plans switched off and on in alternation (`plain_products`),
so both sides see the same context lengths and machine load. Informational: the plans are
measured per machine, and a BLAS without the cliff gets no plan and a ratio of ~1.
"""
from __future__ import annotations

import random
import time
from pathlib import Path

from bench.common import BENCH_SEED, median, progress, prompt_ids
from bench.report import Row, ratio

RUNNING = 15
STEPS = 4  # decode steps timed per turn
TURNS = 3  # turns of (plain, planned)


def run(path: Path, config, vocab: int) -> Row:
    from hyrax.actors.engine.local import engine_for_model, run_to_completion
    from hyrax.actors.engine.request import SamplingParams
    from hyrax.actors.model.gemm_rows import plain_products
    from hyrax.actors.model.loader import load_model

    progress(f"serving: large model, in-process decode steps at {RUNNING} running, row plans off and on")
    model = load_model(str(path))
    engine = engine_for_model(model, config, None, "cpu", tokenizer_dir=str(path))
    rng = random.Random(BENCH_SEED + 7)
    for _ in range(RUNNING):
        engine.add_request(prompt_ids(rng, 48, vocab=vocab), SamplingParams(max_tokens=64, ignore_eos=True))
    decoded: dict = {}
    while len(decoded) < RUNNING or min(decoded.values()) < 2:  # every request past its prefill
        for out in engine.step():
            decoded[out.req_id] = decoded.get(out.req_id, 0) + len(out.new_token_ids)
    times: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(TURNS):
        for planned in (False, True):
            t0 = time.perf_counter()
            if planned:
                for _ in range(STEPS):
                    engine.step()
            else:
                with plain_products(model):
                    for _ in range(STEPS):
                        engine.step()
            times[planned].append((time.perf_counter() - t0) / STEPS * 1e3)
    run_to_completion(engine)
    plain, planned = median(times[False]), median(times[True])
    return Row(f"serving large model: decode step ms at {RUNNING} running, row-planned linear layers vs plain "
               f"(in-process)", planned, plain, ratio(planned, plain))
