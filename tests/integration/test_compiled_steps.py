"""Steps through a Ray Compiled Graph over the rank actors (hyrax/actors/step_graph.py), the
fallback to plain actor calls, and what a failure inside the graph becomes.

Built like a replica: TP=2 `RankWorker` actors and an `Engine` over a `RayExecutor`, driven
from the test process (the coordinator actor does the same in its engine loop).
"""
from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest
import ray

from hyrax.actors.cpu_claims import thread_cpu_sets
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.engine import Engine
from hyrax.actors.engine.executor import RankFailure
from hyrax.actors.engine.local import run_to_completion
from hyrax.actors.engine.pools import host_pool_rows, pool_sizes_for
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.hybrid import resolve_dtype
from hyrax.actors.model.sharding import TP
from hyrax.actors.model.state import derive_components
from hyrax.actors.rank import RankWorker
from hyrax.actors.ray_executor import RayExecutor
from hyrax.actors.step_bell import StepBell
from hyrax.actors.step_graph import compile_steps
from ray_harness import DEMO_CONFIG, DEMO_MODEL, assert_clean, call, deployed, prompt, reference, replica, run_all

CONFIG = EngineConfig(deterministic=True, overlap=True, kv_capacity_tokens=4096, mamba_slots=16)
PROMPTS = [prompt(n, seed=300 + n) for n in (5, 33, 70)]
MAX_TOKENS = 12


class RankPair:
    """TP=2 rank actors shared by the module's tests (each builds its own Engine and executor
    over them); a test that kills one discards the pair, and the next `live()` starts another."""

    def __init__(self):
        self.ranks: list | None = None
        self.started = 0

    def live(self) -> list:
        if self.ranks is None:
            ranks = [RankWorker.options(num_cpus=0).remote("graph-test", self.started, k, 2) for k in range(2)]
            self.started += 1  # a pair started after a discarded one is another replica
            addr = ray.get(ranks[0].dist_address.remote())
            ray.get([r.setup.remote(DEMO_MODEL, CONFIG, addr) for r in ranks], timeout=300)
            self.ranks = ranks
        return self.ranks

    def discard(self) -> None:
        for r in self.ranks or ():
            ray.kill(r, no_restart=True)
        self.ranks = None


@pytest.fixture(scope="module")
def rank_pair(ray_session):
    pair = RankPair()
    yield pair
    pair.discard()


@pytest.fixture
def tp2_ranks(rank_pair):
    return rank_pair.live()


def _engine(executor: RayExecutor, config: EngineConfig = CONFIG) -> Engine:
    cfg = ModelConfig.from_dir(DEMO_MODEL)
    comps = derive_components(cfg, TP(0, 2), resolve_dtype(config.dtype, "cpu"))
    sizes = pool_sizes_for(comps, config)
    return Engine(comps, sizes, host_pool_rows(comps, sizes, config.host_pool_mb), executor, config,
                  cfg.vocab_size, cfg.max_position_embeddings, cfg.eos_token_id)


def _run(engine: Engine) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in PROMPTS]
    run_to_completion(engine)
    out = [engine.finished_requests.pop(i).output_ids for i in ids]
    engine.check_invariants()
    return out


def test_steps_run_through_the_graph_and_equal_the_reference(tp2_ranks):
    want = reference(DEMO_MODEL, CONFIG, PROMPTS, MAX_TOKENS)
    executor = RayExecutor(tp2_ranks, 60.0, compiled=True)
    try:
        assert _run(_engine(executor)) == want
        assert executor.step_path == "compiled graph"
        # a state move (a plain actor call, on the ranks' main thread) between graph steps
        engine = _engine(executor)
        rid = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        while len(engine.requests[rid].output_ids) < 4:
            engine.step()
        assert engine.retract([rid], mode="cpu_tensor", hold=True)[rid] == "cpu_tensor"
        assert engine.resume([rid])[rid] == "verified"
        run_to_completion(engine)
        assert engine.finished_requests.pop(rid).output_ids == want[1]
        engine.check_invariants()
    finally:
        executor.close(wait=True)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no-overlap"])
def test_step_results_come_with_the_ranks_rings(tp2_ranks, monkeypatch, overlap):
    """Every step's results reach the coordinator with the ranks' rings (step_bell.py), not
    through the graph's output, which Ray writes only after the rank's method returned: each
    collect took a result from every rank's ring, and the tokens are the reference's, with
    steps pipelined two deep and one at a time (the graph's outputs are then read at
    different points of the next step)."""
    taken: list[list[bool]] = []
    inner = StepBell.take

    def counted(self, step):
        got = inner(self, step)
        taken.append([r is not None for r in got])
        return got

    monkeypatch.setattr(StepBell, "take", counted)
    executor = RayExecutor(tp2_ranks, 60.0, compiled=True)
    try:
        assert _run(_engine(executor, replace(CONFIG, overlap=overlap))) == reference(DEMO_MODEL, CONFIG, PROMPTS,
                                                                                     MAX_TOKENS)
        assert executor.step_path == "compiled graph"
        assert len(taken) >= MAX_TOKENS and all(k == [True, True] for k in taken), taken
    finally:
        executor.close(wait=True)


def test_the_stepping_thread_keeps_off_the_cpus_the_ranks_claimed(tp2_ranks):
    """A CPU rank claims a CPU of its own where one is free (never the first of its CPUs:
    cpu_claims.py) with every thread of its process on it, and the process that steps the
    replica's graph, every thread of it, keeps off the CPUs this replica's ranks claimed while
    the graph lasts, so a rank's ring does not wake the stepping thread on the rank's CPU and no
    other thread takes the rank's CPU; they get their CPUs back at close. (Whether this pair got
    a claim depends on what else runs on the machine: a rank of an earlier test may still hold
    the only claimable CPU of a 2-CPU machine.)"""
    import os

    before = os.sched_getaffinity(0)
    here = ray.get_runtime_context().get_node_id()
    reports = [c for c in ray.get([r.cpu_claim.remote() for r in tp2_ranks]) if c]
    assert all(c["node"] == here for c in reports)
    claims = {cpu for c in reports for cpu in c["cpus"]}
    assert min(before) not in claims
    pinned = ray.get([r.pinned_threads.remote() for r in tp2_ranks])
    for report, threads in zip(ray.get([r.cpu_claim.remote() for r in tp2_ranks]), pinned):
        if report:  # every thread of that rank's process on its claimed CPUs only
            assert threads == {tuple(report["cpus"])}, threads
    executor = RayExecutor(tp2_ranks, 60.0, compiled=True, cpu_affinity=True)
    try:
        assert _run(_engine(executor)) == reference(DEMO_MODEL, CONFIG, PROMPTS, MAX_TOKENS)
        assert os.sched_getaffinity(0) == (before - claims if claims else before)
        # every thread of the stepping process, not only the stepping one (Ray's, the feed's)
        assert thread_cpu_sets() == {tuple(sorted(before - claims if claims else before))}
    finally:
        executor.close(wait=True)
    assert os.sched_getaffinity(0) == before
    assert thread_cpu_sets() == {tuple(sorted(before))}


def test_waiting_for_a_graph_step_sleeps_instead_of_polling(tp2_ranks):
    """Ray's channel read polls (a reader waiting for a step's result keeps a core busy, CPU the
    ranks' forward needs); the coordinator waits on the ranks' step bell instead (step_bell.py).
    The waiting thread's CPU time over the steps' collects stays a small part of their wall time
    (polling: 50-100 %)."""
    executor = RayExecutor(tp2_ranks, 60.0, compiled=True)
    inner, spent = executor.collect, {"cpu": 0.0, "wall": 0.0}

    def timed_collect(handle):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return inner(handle)
        finally:
            spent["cpu"] += time.thread_time() - c
            spent["wall"] += time.perf_counter() - t

    executor.collect = timed_collect  # instance attribute: this executor only
    try:
        assert _run(_engine(executor)) == reference(DEMO_MODEL, CONFIG, PROMPTS, MAX_TOKENS)
        assert executor.step_path == "compiled graph"
        assert spent["wall"] > 0.05, spent  # the collects did wait for the ranks
        assert spent["cpu"] < 0.2 * spent["wall"], spent
    finally:
        executor.close(wait=True)


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process on this machine (/proc)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def test_idle_ranks_park_answer_calls_and_wake_for_the_next_step(tp2_ranks):
    """Ray's side of the graph waits for the next plan by polling: an idle rank kept a whole
    core busy. Parked (`RayExecutor.rest`, step_bell.py) it sleeps on the step bell, answers
    plain calls, wakes for the next step, and lets the graph be torn down at once."""
    want = reference(DEMO_MODEL, CONFIG, PROMPTS, MAX_TOKENS)
    pids = ray.get([r.__ray_call__.remote(lambda self: os.getpid()) for r in tp2_ranks])
    executor = RayExecutor(tp2_ranks, 60.0, compiled=True)
    try:
        engine = _engine(executor)
        assert _run(engine) == want
        executor.rest()
        executor.rest()  # already parked: nothing more is sent
        time.sleep(0.2)
        before = [_cpu_seconds(p) for p in pids]
        time.sleep(1.0)
        used = [_cpu_seconds(p) - b for p, b in zip(pids, before)]
        assert max(used) < 0.3, used  # polling: ~1 s of CPU each
        executor.probe()  # plain calls, on the ranks' main threads, answer meanwhile
        assert _run(engine) == want  # the next step woke them
        assert executor.step_path == "compiled graph"
        executor.rest()
        t0 = time.monotonic()
        executor.close(wait=True)  # a rank still parked would hold Ray's teardown for 30 s
        assert time.monotonic() - t0 < 10
        again = RayExecutor(tp2_ranks, 60.0, compiled=True)  # the ranks are free for a new graph
        try:
            assert _run(_engine(again)) == want and again.step_path == "compiled graph"
        finally:
            again.close(wait=True)
    finally:
        executor.close(wait=True)


def test_without_the_graph_steps_are_actor_calls(tp2_ranks):
    """The default path (no `--compiled-graph`), and the fallback where no graph can be built."""
    want = reference(DEMO_MODEL, CONFIG, PROMPTS, MAX_TOKENS)
    off = RayExecutor(tp2_ranks, 60.0, compiled=False)
    assert _run(_engine(off)) == want
    assert off.step_path.startswith("actor calls")
    graph, why = compile_steps([object()])  # not an actor: no graph can be built over it
    assert graph is None and why.startswith("actor calls (AttributeError"), why


def test_a_rank_killed_under_the_graph_is_a_rank_failure(rank_pair):
    ranks = rank_pair.live()  # the pair the tests above used (started here when run alone)
    executor = RayExecutor(ranks, 30.0, compiled=True)
    engine = _engine(executor)
    try:
        engine.add_request(PROMPTS[2], SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(3):
            engine.step()
        assert executor.step_path == "compiled graph"
        ray.kill(ranks[1], no_restart=True)
        t0 = time.monotonic()
        with pytest.raises(RankFailure):
            for _ in range(5):
                engine.step()
        assert time.monotonic() - t0 < 15  # not the rank timeout: rank 0 may wait in an all-reduce
    finally:
        rank_pair.discard()
        executor.close(wait=True)


def test_a_rank_killed_while_parked_is_a_rank_failure(rank_pair):
    ranks = rank_pair.live()
    executor = RayExecutor(ranks, 30.0, compiled=True)
    engine = _engine(executor)
    try:
        _run(engine)
        executor.rest()
        ray.kill(ranks[1], no_restart=True)
        engine.add_request(PROMPTS[0], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True))
        t0 = time.monotonic()
        with pytest.raises(RankFailure):
            for _ in range(5):
                engine.step()
        # whether the kill landed before the wake or during the next step (rank 0 then waits in
        # the step's all-reduce and never rings): found when the dead rank's bell ends
        assert time.monotonic() - t0 < 15  # found by the wake, not after a hang
    finally:
        rank_pair.discard()
        executor.close(wait=True)


def test_a_replica_with_the_graph_serves_through_it(ray_session):
    """The coordinator actor builds the graph and its step bell over its own ranks (the bell
    listens on the coordinator's node address) and serves the reference outputs through it."""
    from hyrax.cluster.deployment import RoleSpec

    config = replace(DEMO_CONFIG, compiled_graph=True)
    prompts = [prompt(n, seed=400 + n) for n in (7, 40)]
    with deployed(DEMO_MODEL, [RoleSpec("graph-tp2", 1, 2)], config) as d:
        coord = replica(d, "graph-tp2").coordinator
        streams = run_all(coord, prompts, MAX_TOKENS, prefix="graph-tp2-")
        assert [s.tokens for s in streams] == reference(DEMO_MODEL, config, prompts, MAX_TOKENS)
        assert call(coord.health)["step_path"] == "compiled graph"
        assert_clean(coord)
