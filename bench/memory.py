"""Suite 5 — memory, in-process (demo checkpoint: every component kind).

Bytes per request per component: requests of several lengths (shorter and longer than the
sliding window) are retracted with `cpu_tensor` backups; the bytes each component's backup
tensors actually hold on the rank (`RankRuntime.backups`) — which must also equal what the
manifest records — are compared with `bytes_formula(components, num_tokens)` (target:
exactly 1.0).

RSS: a stream of short requests (max_tokens 4, prompts 8..64 tokens, several at a time) with
forced retraction every few steps, consumed the way the engine loop consumes them (finished
requests popped). Process RSS (psutil if installed, else VmRSS) after `memory_total`
requests vs after the first `memory_first` (target: ratio <= 1.10, i.e. no growth beyond
noise).
"""
from __future__ import annotations

import gc
import random

from bench.common import BENCH_SEED, Profile, load_demo_engine, progress, prompt_ids, rss_bytes, run_until
from bench.report import Row, ratio


def _formula_rows(profile: Profile) -> list[Row]:
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.request import SamplingParams
    from hyrax.actors.model.state import bytes_formula

    engine = load_demo_engine(EngineConfig(kv_capacity_tokens=8192, mamba_slots=16, max_running=16))
    rank = engine.executor.rank
    rng = random.Random(BENCH_SEED)
    params = SamplingParams(max_tokens=1000, ignore_eos=True)
    ids = [engine.add_request(prompt_ids(rng, n), params) for n in profile.memory_formula_prompts]
    ids.append(engine.add_request(prompt_ids(rng, 3), params))  # keeps one running: never retract the last
    run_until(engine, lambda: all(len(engine.requests[i].output_ids) >= 2 for i in ids))
    measured = {c.name: 0 for c in engine.components}
    formula = dict(measured)
    recorded = dict(measured)
    for rid in ids[:-1]:
        if engine.retract([rid], mode="cpu_tensor", hold=True)[rid] != "cpu_tensor":
            raise RuntimeError("memory: a cpu_tensor backup fell back")
        m = engine.requests[rid].backup.manifest
        held = rank.backups[rid].parts  # each component's rows, views of the backup's one packed buffer
        for c in engine.components:
            measured[c.name] += held[c.name].numel() * held[c.name].element_size()
            recorded[c.name] += m.components[c.name].bytes
            formula[c.name] += bytes_formula(engine.components, m.num_tokens)[c.name]
    for rid in ids:
        engine.abort(rid)
    engine.step_outputs_flush()
    engine.check_invariants()
    lens = ", ".join(str(n) for n in profile.memory_formula_prompts)
    rows = []
    for c in engine.components:
        if recorded[c.name] != measured[c.name]:
            raise RuntimeError(f"memory: {c.name}: the manifest records {recorded[c.name]} bytes, "
                               f"the backup holds {measured[c.name]}")
        rows.append(Row(f"state bytes, {c.name} ({c.kind}; requests of {lens} tokens) vs bytes_formula",
                        measured[c.name], formula[c.name], ratio(measured[c.name], formula[c.name]), "== 1"))
    return rows


def _rss_rows(profile: Profile) -> list[Row]:
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.request import SamplingParams

    engine = load_demo_engine(EngineConfig(kv_capacity_tokens=4096, mamba_slots=16, max_running=16,
                                           forced_retraction_interval=profile.memory_forced_interval))
    rng = random.Random(BENCH_SEED)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    submitted = done = 0
    marks: dict[int, int] = {}

    def feed():
        nonlocal submitted
        while submitted < profile.memory_total and len(engine.requests) < profile.memory_concurrency:
            engine.add_request(prompt_ids(rng, rng.randint(8, 64)), params)
            submitted += 1

    feed()
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                engine.finished_requests.pop(out.req_id, None)  # what EngineLoop does on delivery
                done += 1
                if done in (profile.memory_first, profile.memory_total):
                    gc.collect()
                    marks[done] = rss_bytes()
        feed()
    engine.check_invariants()
    if not engine.is_idle_clean():
        raise RuntimeError("memory: pools not empty after the request stream")
    retractions = sum(engine.stats.retractions.values())
    if retractions == 0:
        raise RuntimeError("memory: no forced retraction happened")
    first, last = marks[profile.memory_first], marks[profile.memory_total]
    progress(f"memory: {retractions} retractions, {engine.stats.restores['verified']} verified restores")
    mb = 2**20
    return [Row(f"RSS MiB after {profile.memory_total} requests (forced retraction) vs after {profile.memory_first}",
                last / mb, first / mb, ratio(last, first), profile.target("<= 1.1"))]


def run(profile: Profile) -> list[Row]:
    progress(f"memory: state bytes vs bytes_formula, prompts {list(profile.memory_formula_prompts)}")
    rows = _formula_rows(profile)
    progress(f"memory: RSS over {profile.memory_total} short requests with forced retraction")
    return rows + _rss_rows(profile)
