"""Between steps the loop also calls the ranks (the idle pool check counts their backups; the
liveness probe pings them). A rank failure there used to escape the loop thread: the thread
ended, the replica still said healthy, and every later request waited forever. It is recovered
like a failed step now, and an idle replica finds a dead rank by itself."""
from __future__ import annotations

import asyncio
import threading
import time

from engine_helpers import HYBRID, assert_idle_clean, greedy, make_engine, tiny_model
from hyrax.actors.engine.executor import RankFailure
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.step_feed import Sink, is_last


def _serve_one(loop: EngineLoop, rid: str) -> dict:
    """Run one request through `loop`; its last item (or a timeout)."""
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    done: dict[str, dict] = {}

    def deliver(batch):
        for r, item in batch:
            if is_last(item):
                done[r] = item
    loop.submit(rid, [1, 2, 3, 4, 5], {"max_tokens": 3, "ignore_eos": True, "temperature": 0.0}, Sink(deliver, aloop))
    deadline = time.monotonic() + 30
    while rid not in done and time.monotonic() < deadline:
        time.sleep(0.005)
    aloop.call_soon_threadsafe(aloop.stop)
    assert rid in done, f"{rid} never finished: the loop thread is {'alive' if loop.thread.is_alive() else 'dead'}"
    return done[rid]


def _wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def test_a_rank_failure_in_the_idle_pool_check_is_recovered_and_the_loop_lives_on():
    engine = make_engine(tiny_model(HYBRID))
    inner, raised = engine.check_invariants, []

    def check():
        if not raised:
            raised.append(RankFailure("num_backups failed on a rank: ActorDiedError"))
            raise raised[0]
        inner()
    engine.check_invariants = check
    recovered: list[Exception] = []
    loop = EngineLoop(engine, "idle-rank-failure", on_rank_failure=recovered.append)
    try:
        _wait_for(lambda: recovered, "the idle check's rank failure was never recovered")
        assert recovered == raised and loop.thread.is_alive()
        assert _serve_one(loop, "after")["finish_reason"] == "length"
    finally:
        loop.shutdown()
    assert_idle_clean(engine)


def _offers_bookkeeping_fails_once(engine) -> list:
    """The engine's next reclaim of expired offers (between steps) raises; returns a list that
    holds one item once it has."""
    inner, raised = engine.reclaim_expired_offers, []

    def reclaim():
        if not raised:
            raised.append(1)
            raise RuntimeError("a bug in the offers' bookkeeping")
        inner()
    engine.reclaim_expired_offers = reclaim
    return raised


def test_an_error_between_steps_without_a_recovery_hook_is_logged_and_the_loop_lives_on():
    engine = make_engine(tiny_model(HYBRID))
    raised = _offers_bookkeeping_fails_once(engine)
    loop = EngineLoop(engine, "housekeeping-error")
    try:
        _wait_for(lambda: raised and loop.last_error, "the error was never seen")
        assert "a bug in the offers' bookkeeping" in loop.last_error and loop.thread.is_alive()
        assert _serve_one(loop, "after")["finish_reason"] == "length"
    finally:
        loop.shutdown()
    assert_idle_clean(engine)


def _hook_failing_once(note, calls: list, failure: Exception):
    """A loop hook (probe, rest) that appends `note()` to `calls` each time and raises `failure`
    at its second call."""
    def hook():
        calls.append(note())
        if len(calls) == 2:
            raise failure
    return hook


def test_an_idle_loop_probes_its_ranks_and_recovers_when_one_fails():
    engine = make_engine(tiny_model(HYBRID))
    probes: list[float] = []
    failure = RankFailure("ping failed on a rank: ActorDiedError")
    probe = _hook_failing_once(time.monotonic, probes, failure)
    recovered: list[Exception] = []
    loop = EngineLoop(engine, "probe", on_rank_failure=recovered.append, probe=probe)
    loop.probe_every_s = 0.05
    try:
        _wait_for(lambda: recovered, "the failed probe was never recovered")
        assert recovered == [failure] and loop.thread.is_alive()
        _wait_for(lambda: len(probes) >= 4, "probing stopped after a recovery")
        assert _serve_one(loop, "after")["finish_reason"] == "length"
    finally:
        loop.shutdown()
    gaps = [b - a for a, b in zip(probes, probes[1:])]
    assert min(gaps) >= 0.05 - 0.005, gaps  # at most one ping per interval
    assert_idle_clean(engine)


def test_the_loop_rests_its_ranks_only_while_it_has_nothing_to_run():
    """`rest` (the Ray executor parks the ranks of its compiled graph) is called between steps
    whenever the engine has no work, never while a request runs; a rank failure it raises is
    recovered like any other."""
    engine = make_engine(tiny_model(HYBRID))
    rests: list[bool] = []  # per call: whether the engine had work then
    failure = RankFailure("parking the ranks failed: ActorDiedError")
    rest = _hook_failing_once(engine.has_work, rests, failure)
    recovered: list[Exception] = []
    loop = EngineLoop(engine, "rest", on_rank_failure=recovered.append, rest=rest)
    try:
        _wait_for(lambda: recovered, "the failed rest was never recovered")
        assert recovered == [failure] and loop.thread.is_alive()
        before = len(rests)
        assert _serve_one(loop, "after")["finish_reason"] == "length"
        _wait_for(lambda: len(rests) > before + 1, "the loop stopped resting after a request")
    finally:
        loop.shutdown()
    assert rests and not any(rests), "rest was called while the engine had work"
    assert_idle_clean(engine)


def test_an_engine_error_without_a_recovery_hook_frees_the_backups_its_live_rank_holds():
    """Without a recovery hook (an in-process replica) an engine error fails every request and
    the ranks stay: a request retracted to rank memory then left its backup there for good (the
    rank's tensors never freed, and each idle check after it reported the pools violated)."""
    engine = make_engine(tiny_model(HYBRID), retraction_backup="cpu_tensor")
    rid = engine.add_request([1, 2, 3, 4, 5, 6], greedy(max_tokens=8, ignore_eos=True))
    for _ in range(3):
        engine.step()
    assert engine.retract([rid], hold=True)[rid] == "cpu_tensor"
    assert engine.executor.num_backups() == {0: 1}
    raised = _offers_bookkeeping_fails_once(engine)
    loop = EngineLoop(engine, "engine-error-with-a-backup")
    loop.idle_check_after_s = 0.0
    try:
        _wait_for(lambda: raised and loop.last_error and not engine.has_unfinished(), "the error never failed it")
        _wait_for(lambda: loop._checked_idle, "the idle check never ran")
        assert loop.invariant_error is None, loop.invariant_error
    finally:
        loop.shutdown()
    assert engine.stats.finished == {"error": 1} and rid not in engine.requests
    assert_idle_clean(engine)


def test_a_replica_holding_only_held_requests_probes_its_ranks_and_recovers_when_one_fails():
    """An operator retracted every request with hold: nothing runs, the ranks are parked, and no
    step would find a rank that died. The probe ran only when no request was there at all, so
    such a replica said healthy with a dead rank until the operator's resume found it (answered
    ranks_failed; seen live with hyrax serve, a rank killed after a retract --all --hold). It
    probes whenever it has nothing to run now; the held request stays held, and runs once
    resumed."""
    from hyrax.actors.engine.commands import Resume, Retract
    from hyrax.actors.engine.lifecycle import Outcome
    from hyrax.actors.engine.request import SamplingParams, State
    from hyrax.actors.engine.selection import Selection

    engine = make_engine(tiny_model(HYBRID), retraction_backup="cpu_tensor")
    dead = threading.Event()
    probes: list[bool] = []  # per call: whether the engine held a request then

    def probe():
        probes.append(engine.has_unfinished())
        if dead.is_set():
            dead.clear()  # the recovery below brings a working rank
            raise RankFailure("ping failed on a rank: ActorDiedError")

    def recover(err):  # as the coordinator's: a new rank (no backup), every request rebuilt from its tokens
        recovered.append(err)
        for rid in list(engine.executor.rank.backups):
            engine.executor.rank.discard(rid)
        engine.reset_for_recovery()
    recovered: list[Exception] = []
    loop = EngineLoop(engine, "probe-held", on_rank_failure=recover, probe=probe)
    loop.probe_every_s = 0.05
    try:
        with loop.lock:
            engine.add_request([1, 2, 3, 4, 5], SamplingParams(max_tokens=200, ignore_eos=True), "held")
        _wait_for(lambda: "held" in engine.requests and engine.requests["held"].state == State.RUNNING, "never ran")
        assert loop.retract(Retract(Selection(ids=("held",)), hold=True))["held"] == Outcome.CPU_TENSOR
        dead.set()
        _wait_for(lambda: recovered, "the dead rank of a replica holding a held request was never found")
        req = engine.requests["held"]
        assert req.state == State.RETRACTED and req.hold and any(probes), (req.state, req.hold, probes)
        assert loop.resume(Resume(Selection(ids=("held",)))) == {"held": Outcome.RECOMPUTE}
        _wait_for(lambda: "held" not in engine.requests, "the resumed request never finished")
    finally:
        loop.shutdown()
    engine.finished_requests.clear()
    assert_idle_clean(engine)
