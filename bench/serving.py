"""Suite 1 — serving throughput and latency over HTTP, full stack, vs transformers.

Hyrax: the gateway (uvicorn, in this process, 127.0.0.1:<free port>) over a Ray deployment of
one colocated TP=1 replica (`hyrax serve`'s engine defaults, pools sized so that nothing is
retracted), serving a random Bamba checkpoint written by transformers' `save_pretrained`. A
separate load-generator process (bench/loadgen.py) drives a fixed synthetic workload (seeded:
prompt token ids of 32..512 tokens, greedy, `ignore_eos`, exact output lengths) in a closed
loop at each concurrency, streaming every completion.

Baseline, same weights, same run, same torch thread budget as one Hyrax rank: transformers
`BambaForCausalLM.generate` (a) one request at a time over the target concurrency's
workload, timing each new token with a streamer, and (b) in static left-padded batches of
`target concurrency` requests (a batch decodes until its longest request is done; only the
requested tokens count).

Rows: output tok/s at each concurrency vs sequential transformers (target >= 5x at
concurrency 16) and vs static batches; the full stack vs the same workload through an
in-process engine (no HTTP, no Ray: what the stack costs), split by a run through Ray without
HTTP (an engine client in this process) after each HTTP run; TTFT and ITL p50/p99 (client-side,
from SSE chunk arrival) vs transformers' sequential per-request TTFT/ITL.

Repeats: on the shared 2-core VM one run of the same workload moved +-15 % from the next, so
the concurrency-1 and target-concurrency workloads run `serving_repeats` times over HTTP (the
prefix cache flushed before each run, so every run prefills the same prompts), with an
in-process run before, between and after them; throughput rows take the median run, latency
rows the percentiles of every run's requests together. Transformers' halves run before and
after all of it, so that the machine's drift over the run falls on both sides. The "large model"
rows repeat concurrency 16 on a ~110M-parameter Bamba checkpoint (targets: >= 6x sequential,
>= 1.5x static batches), where weight reads, not Python, dominate a step.
"""
from __future__ import annotations

import dataclasses
import random
import tempfile
import time
from pathlib import Path

from bench import row_plans
from bench.common import (BENCH_SEED, Profile, make_bamba_checkpoint, median, percentile, progress, prompt_ids,
                          quiet_transformers)
from bench.report import Row, ratio
from bench.stack import GatewayStack, serve_defaults

MODEL_NAME = "bench-bamba"
LARGE_CONCURRENCY = 16
LARGE_VOCAB = 8192  # BAMBA_LARGE_KW's


def large_workload(profile: Profile) -> list[dict]:
    rng = random.Random(BENCH_SEED + 1_000)
    lo, hi = profile.large_prompt_range
    olo, ohi = profile.large_out_range
    return [{"prompt": prompt_ids(rng, rng.randint(lo, hi), vocab=LARGE_VOCAB), "max_tokens": rng.randint(olo, ohi)}
            for _ in range(profile.large_requests)]


def workload(profile: Profile, concurrency: int) -> list[dict]:
    rng = random.Random(BENCH_SEED + concurrency)
    lo, hi = profile.serving_prompt_range
    olo, ohi = profile.serving_out_range
    return [{"prompt": prompt_ids(rng, rng.randint(lo, hi)), "max_tokens": rng.randint(olo, ohi)}
            for _ in range(profile.serving_requests[concurrency])]


# ---- baseline: transformers generate -------------------------------------------------------
class _Transformers:
    """transformers `generate` on the checkpoint; accumulates tokens and seconds over calls."""

    def __init__(self, path: Path):
        import torch
        import transformers

        quiet_transformers()
        self.torch = torch
        self.model = transformers.BambaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        self.seq = {"tokens": 0, "seconds": 0.0, "ttft": [], "itl": []}
        self.static = {"tokens": 0, "seconds": 0.0}
        self._gen([list(range(32))], 4)  # warm-up

    def _gen(self, ids: list[list[int]], new: int, streamer=None) -> None:
        torch = self.torch
        width = max(len(p) for p in ids)
        x = torch.zeros(len(ids), width, dtype=torch.long)  # left padding with pad id 0
        mask = torch.zeros(len(ids), width, dtype=torch.long)
        for i, p in enumerate(ids):
            x[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        with torch.inference_mode():
            out = self.model.generate(x, attention_mask=mask, max_new_tokens=new, do_sample=False,
                                      streamer=streamer, pad_token_id=0)
        if out.shape[1] - width != new:
            raise RuntimeError("serving: transformers stopped before max_new_tokens")

    def sequential(self, reqs: list[dict]) -> None:
        """One request at a time; a streamer stamps every new token (TTFT, ITL)."""
        from transformers.generation.streamers import BaseStreamer

        class Stamps(BaseStreamer):
            def __init__(self):
                self.times: list[float] = []

            def put(self, value):  # the first call carries the prompt, then one call per new token
                self.times.append(time.perf_counter())

            def end(self):
                pass

        for r in reqs:
            s = Stamps()
            t0 = time.perf_counter()
            self._gen([r["prompt"]], r["max_tokens"], s)
            self.seq["seconds"] += time.perf_counter() - t0
            self.seq["tokens"] += r["max_tokens"]
            self.seq["ttft"].append(s.times[1] - t0)
            self.seq["itl"] += [b - a for a, b in zip(s.times[1:], s.times[2:])]

    def static_batches(self, batches: list[list[dict]]) -> None:
        """Left-padded batches decoded to their longest request; only requested tokens count."""
        for group in batches:
            t0 = time.perf_counter()
            self._gen([r["prompt"] for r in group], max(r["max_tokens"] for r in group))
            self.static["seconds"] += time.perf_counter() - t0
            self.static["tokens"] += sum(r["max_tokens"] for r in group)

    def run_share(self, reqs: list[dict], batch: int, part: int) -> None:
        """Half `part` (0 or 1) of the baseline: every other request, every other batch. The
        halves run before and after Hyrax's runs, so both sides see the same machine load."""
        batches = [reqs[k:k + batch] for k in range(0, len(reqs), batch)]
        progress(f"serving: transformers baseline, part {part + 1}/2: sequential and static batches of {batch}")
        self.sequential(reqs[part::2])
        self.static_batches(batches[part::2])


# ---- Hyrax: gateway + Ray deployment ---------------------------------------------------------
def _stack(model_dir: Path, max_concurrency: int) -> GatewayStack:
    """One colocated TP=1 replica with `hyrax serve`'s defaults, pools sized so that the
    workload never retracts."""
    from hyrax.cluster.deployment import RoleSpec

    config = dataclasses.replace(serve_defaults(), kv_capacity_tokens=65536, mamba_slots=max_concurrency + 8,
                                 max_running=max(64, max_concurrency))
    return GatewayStack(str(model_dir), MODEL_NAME, [RoleSpec("colocated", 1, 1)], config, "serving")


def _load(stack: GatewayStack, reqs: list[dict], concurrency: int, warmup: list[dict]) -> dict:
    return stack.run_clients("bench.loadgen", {"concurrency": concurrency, "requests": reqs, "warmup": warmup})


def _in_process_tps(model_dir: Path, reqs: list[dict], concurrency: int, config) -> float:
    """The same workload through an in-process engine (no HTTP, no Ray), closed loop: what the
    engine alone sustains, to separate serving-stack costs from engine costs."""
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.engine.request import SamplingParams

    engine = load_engine(str(model_dir), config)
    queue, tokens = list(reqs)[::-1], 0
    t0 = time.perf_counter()
    while queue or engine.has_unfinished():
        while queue and len(engine.requests) < concurrency:
            r = queue.pop()
            engine.add_request(r["prompt"], SamplingParams(max_tokens=r["max_tokens"], ignore_eos=True))
        for out in engine.step():
            tokens += len(out.new_token_ids)
            if out.finished:
                engine.finished_requests.pop(out.req_id, None)
    return tokens / (time.perf_counter() - t0)


def _ray_direct_tps(stack: GatewayStack, reqs: list[dict], concurrency: int) -> float:
    """The same workload, closed loop, through an engine client over the same Ray deployment
    from this process (what the gateway calls, without HTTP, the gateway's event loop or the
    load generator): output tok/s. With the in-process and HTTP runs it splits what the stack
    costs between Ray and HTTP. A short or failed request raises (no row measures a broken run)."""
    import asyncio

    from hyrax.cluster.ray_client import client_for

    async def run() -> float:
        client = client_for(stack.dep, MODEL_NAME)
        queue, tokens = list(enumerate(reqs))[::-1], [0]
        tag = f"bench-ray-{time.monotonic_ns()}"

        async def worker() -> None:
            while queue:
                i, r = queue.pop()
                got, last = 0, {}
                async for item in client.generate(f"{tag}-{i}", r["prompt"], {
                        "max_tokens": r["max_tokens"], "ignore_eos": True, "temperature": 0.0}):
                    got, last = got + len(item.get("token_ids") or ()), item
                if got != r["max_tokens"] or last.get("error"):
                    raise RuntimeError(f"serving: Ray-direct request {i} got {got} of {r['max_tokens']} tokens "
                                       f"({last.get('error')})")
                tokens[0] += got

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return tokens[0] / (time.perf_counter() - t0)
    return asyncio.run(run())


def _summarise(runs: list[dict], c: int) -> tuple[tuple, list[float]]:
    """Runs of one workload at concurrency `c`: ((median output tok/s over the runs, every
    TTFT, every ITL, requests failed or short, requests sent), the TTFTs of the requests after
    the first `c` of each run: each arrived into a running batch, not with c-1 others)."""
    tps, ttft, itl, joined, failed, sent = [], [], [], [], 0, 0
    for out in runs:
        res = out["results"]
        ok = [r for r in res if not r.get("error") and r["tokens"] == r["expected"]]
        bad = [r for r in res if r.get("error") or r["tokens"] != r["expected"]]
        if bad:
            progress(f"serving: concurrency {c}: {len(bad)} of {len(res)} requests failed or came back short, "
                     f"e.g. {bad[0]}")
        tps.append(sum(r["tokens"] for r in ok) / out["wall"])
        ttft += [r["ttft"] for r in ok]
        itl += [x for r in ok for x in r["itl"]]
        joined += [r["ttft"] for r in res[c:] if not r.get("error") and r["tokens"] == r["expected"]]
        failed, sent = failed + len(bad), sent + len(res)
    progress(f"serving: concurrency {c}: {', '.join(f'{x:.1f}' for x in tps)} output tok/s")
    return (median(tps), ttft, itl, failed, sent), joined


def _ms(x: float | None) -> float | None:
    return None if x is None else x * 1000.0


def run(profile: Profile) -> list[Row]:
    conc = sorted(profile.serving_requests)
    target_c = profile.serving_target_concurrency if profile.serving_target_concurrency in conc else conc[-1]
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="hyrax-bench-bamba-") as tmp:
        path = make_bamba_checkpoint(Path(tmp))
        base_reqs = workload(profile, target_c)
        stack = _stack(path, max(conc))
        try:
            hf = _Transformers(path)
            hf.run_share(base_reqs, target_c, 0)
            engine_runs: list[float] = []
            ray_runs: list[float] = []  # the target workload through Ray without HTTP
            warm = [{"prompt": list(range(40)), "max_tokens": 4}]
            measured, joined = {}, {}
            for c in conc:
                reqs = workload(profile, c)
                repeats = profile.serving_repeats if c in (1, target_c) else 1
                runs = []
                for k in range(repeats):
                    if c == target_c:  # in-process runs between the HTTP runs: both see the same machine
                        engine_runs.append(_in_process_tps(path, base_reqs, target_c, stack.config))
                        progress(f"serving: the concurrency-{target_c} workload through an in-process engine "
                                 f"(no HTTP, no Ray): {engine_runs[-1]:.1f} output tok/s")
                    stack.flush_cache()  # every run of a workload starts with nothing cached
                    run_of = f", run {k + 1} of {repeats}" if repeats > 1 else ""
                    progress(f"serving: Hyrax over HTTP, concurrency {c} ({len(reqs)} requests{run_of})")
                    runs.append(_load(stack, reqs, c, warm))
                    warm = []
                    if c == target_c:
                        stack.flush_cache()
                        ray_runs.append(_ray_direct_tps(stack, reqs, c))
                        progress(f"serving: the concurrency-{c} workload through Ray without HTTP (an engine "
                                 f"client in this process): {ray_runs[-1]:.1f} output tok/s")
                if c == target_c:
                    engine_runs.append(_in_process_tps(path, base_reqs, target_c, stack.config))
                measured[c], joined[c] = _summarise(runs, c)
            engine_tps = median(engine_runs)
            progress(f"serving: in-process engine {', '.join(f'{x:.1f}' for x in engine_runs)} tok/s "
                     f"(median {engine_tps:.1f})")
            hf.run_share(base_reqs, target_c, 1)
        finally:
            stack.close()
    seq_tps = hf.seq["tokens"] / hf.seq["seconds"]
    static_tps = hf.static["tokens"] / hf.static["seconds"]
    progress(f"serving: transformers sequential {seq_tps:.1f} tok/s, static batches {static_tps:.1f} tok/s")
    for c in conc:
        tps, ttft, itl, failed, sent = measured[c]
        rows.append(Row(f"serving c={c}: requests failed or short (of {sent}); ratio: share", failed, None,
                        failed / sent, "== 0"))
        target = profile.target(">= 5") if c == target_c else ""
        rows.append(Row(f"serving c={c}: output tok/s vs transformers sequential", tps, seq_tps,
                        ratio(tps, seq_tps), target))
        if c == target_c:
            rows.append(Row(f"serving c={c}: output tok/s vs transformers static batches of {target_c}", tps,
                            static_tps, ratio(tps, static_tps), profile.target(">= 1.5")))
            rows.append(Row(f"serving c={c}: output tok/s, full stack vs in-process engine (no HTTP, no Ray)", tps,
                            engine_tps, ratio(tps, engine_tps), profile.target(">= 0.9")))
            # the stack's cost split: Ray (coordinator, compiled graph, feed) alone, and HTTP on top
            ray_tps = median(ray_runs)
            rows.append(Row(f"serving c={c}: output tok/s, Ray without HTTP (engine client in the bench process) "
                            f"vs in-process engine", ray_tps, engine_tps, ratio(ray_tps, engine_tps), ""))
            rows.append(Row(f"serving c={c}: output tok/s, full stack vs Ray without HTTP", tps, ray_tps,
                            ratio(tps, ray_tps), ""))
            rows.append(_prefill_ceiling(f"serving c={c}", hf))
        for name, xs, ref in (("TTFT", ttft, hf.seq["ttft"]), ("ITL", itl, hf.seq["itl"])):
            for q in (50, 99):
                h, b = _ms(percentile(xs, q)), _ms(percentile(ref, q))
                itl_target = profile.target("<= 1.2") if (c, name, q) == (1, "ITL", 50) else ""
                rows.append(Row(f"serving c={c}: {name} p{q} ms (baseline: transformers, 1 request)", h, b,
                                ratio(h, b), itl_target))
    rows += _ttft_under_load(measured, joined, target_c, profile)
    if profile.large_requests:
        rows += run_large(profile)
    return rows


def _ttft_under_load(measured: dict, joined: dict, c: int, profile: Profile) -> list[Row]:
    """TTFT p50/p99 at concurrency `c` against a lone request's TTFT (Hyrax at concurrency 1,
    p50), same stack and run: what chunked prefill interleaved with decode (the engine's
    default step budget) leaves of a new request's wait under load. The closed loop starts with
    `c` requests at once, whose prefills queue behind each other (the quick workload's first 16
    bring ~4,400 prompt tokens); an informational row gives the p50 of the requests after them,
    each arriving into a running batch."""
    if 1 not in measured or c == 1 or not measured[1][1]:
        return []
    lone, rows = _ms(median(measured[1][1])), []
    for q in (50, 99):
        h = _ms(percentile(measured[c][1], q))
        rows.append(Row(f"serving c={c}: TTFT p{q} ms vs a lone request's (Hyrax c=1 TTFT p50)", h, lone,
                        ratio(h, lone), profile.target("<= 3") if q == 50 else ""))
    if joined.get(c):
        h = _ms(median(joined[c]))
        rows.append(Row(f"serving c={c}: TTFT p50 ms of the requests after the first {c} (each joining a running "
                        f"batch) vs a lone request's", h, lone, ratio(h, lone), ""))
    return rows


def run_large(profile: Profile) -> list[Row]:
    """The large model (~110M parameters): the same full stack at concurrency 16 against
    transformers sequential and in static batches of 16, halves before and after Hyrax."""
    c = LARGE_CONCURRENCY
    reqs = large_workload(profile)
    with tempfile.TemporaryDirectory(prefix="hyrax-bench-bamba-large-") as tmp:
        progress("serving: writing the large (~110M-parameter) Bamba checkpoint")
        path = make_bamba_checkpoint(Path(tmp), large=True)
        hf = _Transformers(path)
        hf.run_share(reqs, c, 0)
        stack = _stack(path, c)
        try:
            progress(f"serving: large model, Hyrax over HTTP, concurrency {c} ({len(reqs)} requests)")
            out = _load(stack, reqs, c, [{"prompt": list(range(1, 40)), "max_tokens": 4}])
        finally:
            stack.close()
        hf.run_share(reqs, c, 1)
        plan_row = row_plans.run(path, stack.config, LARGE_VOCAB)
    res = out["results"]
    ok = [r for r in res if not r.get("error") and r["tokens"] == r["expected"]]
    tps = sum(r["tokens"] for r in ok) / out["wall"]
    seq_tps = hf.seq["tokens"] / hf.seq["seconds"]
    static_tps = hf.static["tokens"] / hf.static["seconds"]
    progress(f"serving: large model: Hyrax {tps:.1f} tok/s, transformers sequential {seq_tps:.1f}, "
             f"static batches {static_tps:.1f}")
    itl = [x for r in ok for x in r["itl"]]
    h, b = _ms(median(itl)), _ms(median(hf.seq["itl"]))
    return [
        Row(f"serving large model c={c}: requests failed or short (of {len(res)}); ratio: share", len(res) - len(ok),
            None, (len(res) - len(ok)) / len(res), "== 0"),
        Row(f"serving large model c={c}: output tok/s vs transformers sequential", tps, seq_tps, ratio(tps, seq_tps),
            profile.target(">= 6")),
        Row(f"serving large model c={c}: output tok/s vs transformers static batches of {c}", tps, static_tps,
            ratio(tps, static_tps), profile.target(">= 1.5")),
        Row(f"serving large model c={c}: ITL p50 ms (baseline: transformers, 1 request)", h, b, ratio(h, b)),
        _prefill_ceiling(f"serving large model c={c}", hf),
        plan_row,
    ]


def _prefill_ceiling(what: str, hf: _Transformers) -> Row:
    """What the "vs transformers sequential" ratio could reach if every decode step were free
    and prompts took as long as transformers takes them one at a time (its sequential seconds
    over its time to first token summed): a workload that is mostly prompt caps the ratio
    whatever the server does with batching. Informational."""
    prefill = sum(hf.seq["ttft"])
    return Row(f"{what}: ceiling of the ratio vs sequential if decoding cost nothing (transformers' sequential "
               f"seconds vs its prefill seconds)", hf.seq["seconds"], prefill, ratio(hf.seq["seconds"], prefill))
