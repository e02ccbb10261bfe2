"""Suite 2 — coordination overhead per decode step: coordinator wall time vs the time the
ranks spend in the model step (`RankRuntime.execute`: batch build + forward + sampling).

In-process (TP=1): an `Engine` over one in-process `RankRuntime`; `Engine.step()` is timed
around, `RankRuntime.execute` inside (wrapped on the instance). The difference is the
coordinator's own work: scheduling, plan building, result commit.

Ray (TP=1, TP=2): the same `Engine` + `RayExecutor` the `RoleCoordinator` actor runs,
driven from this process over rank actors. The rank actors are `hyrax.actors.rank.RankWorker`
with one addition made here, in the benchmark: a timer around `execute` (a subclass of the
actor's class, `RankWorker.__ray_actor_class__`; setup, model, pools and all-reduce are
RankWorker's own). Per step, forward = the slowest rank's execute time (a TP step waits for
all of them; it includes the row-parallel all-reduces); overhead = step - forward, which is
the plan fan-out and result gather over Ray plus the coordinator's own work.

Ray rows run three ways: plain steps (`Engine.step`: plan, run, commit) sent through the
compiled graph over the ranks (hyrax/actors/step_graph.py, what `hyrax serve` replicas use
by default), the same with plain actor calls ("actor calls": `--no-compiled-graph`, and the
fallback where no graph can be built), and with overlap scheduling through the graph (`Engine.step`
with `overlap` on, `hyrax serve`'s default: step N+1 is planned and sent before step N is
committed; the per-step pairing of wall time and forward time is then approximate, which is
fine in the steady decode state timed here).

Rows: median step ms (hyrax), median forward ms (baseline), ratio = the median over steps of
(step - forward) / step. Targets at batch 32: overhead <= 10% of the step for Ray TP=1
without overlap, <= 5% with it, <= 15% elsewhere.
"""
from __future__ import annotations

import random
import time

from bench.common import BENCH_SEED, Profile, demo_model_dir, ensure_ray, median, progress, prompt_ids, run_until
from bench.report import Row, ratio

PROMPT = 16


def _config(batch: int, overlap: bool = False):
    from hyrax.actors.engine.config import EngineConfig

    return EngineConfig(kv_capacity_tokens=16384, mamba_slots=batch + 4, max_running=max(batch, 8), overlap=overlap)


def _timed_decode(engine, batch: int, steps: int, forward_of_step) -> tuple[list[float], list[float]]:
    """Admit `batch` requests, finish their prefill, then time `steps` decode-only steps
    (a pipeline of depth 2 when the engine's config says so, as the coordinator's loop does).
    Returns (step seconds, forward seconds) per timed step."""
    from hyrax.actors.engine.request import SamplingParams

    rng = random.Random(BENCH_SEED)
    params = SamplingParams(max_tokens=steps + 64, ignore_eos=True)
    ids = [engine.add_request(prompt_ids(rng, PROMPT), params) for _ in range(batch)]
    run_until(engine, lambda: all(len(engine.requests[i].output_ids) >= 2 for i in ids))  # in decode
    step = engine.step
    step_s = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        step_s.append(time.perf_counter() - t0)
    engine.sync()  # overlap: the last submitted step completes (untimed)
    fwd = forward_of_step(engine.step_count - steps + 1, engine.step_count)
    for i in ids:
        engine.abort(i)
    engine.step_outputs_flush()
    engine.check_invariants()
    return step_s, fwd


def _in_process(batch: int, steps: int) -> tuple[list[float], list[float]]:
    from bench.common import load_demo_engine

    engine = load_demo_engine(_config(batch))
    rank = engine.executor.rank
    inner = rank.execute
    record: dict[int, float] = {}

    def timed(plan):
        t0 = time.perf_counter()
        out = inner(plan)
        record[plan.step] = time.perf_counter() - t0
        return out

    rank.execute = timed  # instance attribute: this engine only
    return _timed_decode(engine, batch, steps, lambda a, b: [record[s] for s in range(a, b + 1)])


def _timed_rank_class():
    import ray

    from hyrax.actors.rank import RankWorker

    base = RankWorker.__ray_actor_class__

    class TimedRankWorker(base):
        """RankWorker with a timer around `execute` (benchmark only)."""

        def execute(self, plan):
            t0 = time.perf_counter()
            out = base.execute(self, plan)
            self.__dict__.setdefault("_bench_times", {})[plan.step] = time.perf_counter() - t0
            return out

        def bench_times(self) -> dict:
            """Execute seconds by plan step since the last call."""
            return self.__dict__.pop("_bench_times", {})

    return ray.remote(**RankWorker._default_options)(TimedRankWorker)  # RankWorker's own actor options


def _engine_over(ranks: list, executor, config):
    """A fresh Engine over `ranks` (the engine owns every index, so a new engine starts from
    empty pools as far as it knows)."""
    from hyrax.actors.engine.engine import Engine
    from hyrax.actors.engine.pools import host_pool_rows, pool_sizes_for
    from hyrax.actors.model.config import ModelConfig
    from hyrax.actors.model.hybrid import resolve_dtype
    from hyrax.actors.model.sharding import TP
    from hyrax.actors.model.state import derive_components

    cfg = ModelConfig.from_dir(demo_model_dir())
    comps = derive_components(cfg, TP(0, len(ranks)), resolve_dtype(config.dtype, "cpu"))
    sizes = pool_sizes_for(comps, config)
    return Engine(comps, sizes, host_pool_rows(comps, sizes, config.host_pool_mb), executor, config, cfg.vocab_size,
                  cfg.max_position_embeddings, cfg.eos_token_id)


def _forward_of(ranks: list):
    """forward(a, b): per step a..b, the slowest rank's execute seconds (since the last call)."""
    import ray

    def forward(a: int, b: int) -> list[float]:
        per_rank = ray.get([r.bench_times.remote() for r in ranks])
        return [max(t[s] for t in per_rank) for s in range(a, b + 1)]
    return forward


def _over_ray(tp: int, batches: tuple[int, ...], steps: int) -> dict[tuple[str, int], tuple[list, list]]:
    """One set of TP rank actors; per (mode, batch), a fresh Engine over them."""
    from hyrax.actors.ray_executor import RayExecutor

    ray = ensure_ray()
    rank_config = _config(max(batches))
    cls = _timed_rank_class()
    ranks = [cls.remote("bench", 0, k, tp) for k in range(tp)]
    out = {}
    try:
        addr = ray.get(ranks[0].dist_address.remote()) if tp > 1 else None
        ray.get([r.setup.remote(demo_model_dir(), rank_config, addr) for r in ranks], timeout=300)
        forward = _forward_of(ranks)

        # (label, overlap, compiled graph): the plain rows keep their names; "actor calls" is
        # the same engine stepping its ranks with plain actor calls (the fallback)
        for label, overlap, compiled in (("", False, True), (" actor calls", False, False), (" overlap", True, True)):
            for batch in batches:
                where = f"Ray TP={tp}{label}"
                progress(f"coordination: {where}, batch {batch}, {steps} decode steps")
                executor = RayExecutor(ranks, 120.0, compiled=compiled, cpu_affinity=True)  # as a coordinator
                engine = _engine_over(ranks, executor, _config(max(batches), overlap))
                ray.get([r.bench_times.remote() for r in ranks])  # drop the previous engine's timings
                out[(label, batch)] = _timed_decode(engine, batch, steps, forward)
                if compiled and not executor.step_path.startswith("compiled graph"):
                    raise RuntimeError(f"coordination: {where} ran on {executor.step_path}")
                executor.close(wait=True)  # the ranks join the next engine's graph
    finally:
        for r in ranks:
            ray.kill(r, no_restart=True)
    return out


def _affinity_row(batch: int, steps: int, rounds: int) -> Row:
    """Ray TP=1 with overlap, batch `batch`: the overhead share with `--cpu-affinity auto` (the
    rank on a CPU of its own, the stepping thread off it) vs `off` (both wherever the OS puts
    them), in alternating rounds over two ranks set up each way (cpu_claims.py)."""
    from dataclasses import replace

    from hyrax.actors.ray_executor import RayExecutor

    ray = ensure_ray()
    cls = _timed_rank_class()
    ranks = {"auto": cls.remote("bench-affinity", 0, 0, 1), "off": cls.remote("bench-affinity", 1, 0, 1)}
    config = _config(batch, overlap=True)
    shares: dict[str, list[float]] = {"auto": [], "off": []}
    try:
        ray.get([r.setup.remote(demo_model_dir(), replace(config, cpu_affinity=mode), None)
                 for mode, r in ranks.items()], timeout=300)
        for k in range(rounds):
            for mode, rank in ranks.items():
                progress(f"coordination: Ray TP=1 overlap, batch {batch}, cpu-affinity {mode}, round {k + 1} of "
                         f"{rounds}, {steps} decode steps")
                executor = RayExecutor([rank], 120.0, compiled=True, cpu_affinity=mode == "auto")
                engine = _engine_over([rank], executor, config)
                ray.get(rank.bench_times.remote())
                step_s, fwd_s = _timed_decode(engine, batch, steps, _forward_of([rank]))
                executor.close(wait=True)
                shares[mode].append(median((s - f) / s for s, f in zip(step_s, fwd_s)))
        claim = (ray.get(ranks["auto"].cpu_claim.remote()) or {}).get("cpus")
    finally:
        for r in ranks.values():
            ray.kill(r, no_restart=True)
    progress(f"coordination: overhead share by round, cpu-affinity auto (rank on CPUs {claim}) "
             f"{', '.join(f'{x:.3f}' for x in shares['auto'])}; off {', '.join(f'{x:.3f}' for x in shares['off'])}")
    auto, off = median(shares["auto"]), median(shares["off"])
    return Row(f"coordination Ray TP=1 overlap, batch {batch}: overhead share with --cpu-affinity auto "
               f"(baseline: off; ratio: auto / off)", auto, off, ratio(auto, off))


# overhead share targets at batch 32: Ray TP=1 steps through the compiled graph (issue 18)
TARGETS = {"Ray TP=1": "<= 0.10", "Ray TP=1 overlap": "<= 0.05"}


def _row(where: str, batch: int, step_s: list[float], fwd_s: list[float], profile: Profile) -> Row:
    share = median((s - f) / s for s, f in zip(step_s, fwd_s))  # per step, so a preempted step counts once
    target = profile.target(TARGETS.get(where, "<= 0.15")) if batch >= 32 else ""
    return Row(f"coordination {where}, batch {batch}: step ms vs rank forward ms (ratio: overhead share)",
               median(step_s) * 1e3, median(fwd_s) * 1e3, share, target)


def run(profile: Profile) -> list[Row]:
    rows = []
    steps = profile.coord_steps
    for batch in profile.coord_batches:
        progress(f"coordination: in-process TP=1, batch {batch}, {steps} decode steps")
        rows.append(_row("in-process TP=1", batch, *_in_process(batch, steps), profile))
    ray_rows = []
    for tp in profile.coord_tps:
        for (label, batch), (step_s, fwd_s) in _over_ray(tp, profile.coord_batches, steps).items():
            ray_rows.append((label == " overlap", tp, _row(f"Ray TP={tp}{label}", batch, step_s, fwd_s, profile)))
    from bench import sampling, step_cpu

    affinity = [_affinity_row(max(profile.coord_batches), steps, 5 if profile.judge_timing else 1)]
    return (rows + [r for _, _, r in sorted(ray_rows, key=lambda x: x[:2])] + affinity + step_cpu.run(profile)
            + sampling.run(profile))
