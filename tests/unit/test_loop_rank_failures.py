"""Ranks that fail outside a step.

An operator's command calls the ranks too: a retraction saves state on them (and discards what
a failed save left), a resume loads it back, an abort discards a backup, the invariant check
counts the backups they hold. A rank that died (or hung past its timeout, or raised: the Ray
executor answers each with RankFailure) during such a command used to raise out of it, past the
loop's guard: the admin caller got the raw error and the lost rank stayed there for the next
step to find. It is recovered now as during a step, and the command answers RANKS_FAILED."""
from __future__ import annotations

import asyncio
import threading
import time

import pytest

from engine_helpers import HYBRID, assert_idle_clean, make_engine, tiny_model
from hyrax.actors.engine.commands import Resume, Retract
from hyrax.actors.engine.executor import RankFailure
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.request import SamplingParams, State
from hyrax.actors.engine.selection import Selection
from hyrax.actors.engine.step_feed import Sink, is_last, is_refusal

MAX_TOKENS = 30


class LostRank:
    """The in-process executor as a lost rank leaves it: every call raises RankFailure, as the
    Ray executor's calls do, until `restart` (the recovery) brings up an empty rank in its
    place."""

    CALLS = ("submit", "collect", "save", "load", "discard", "num_backups")

    def __init__(self, executor):
        self.executor = executor

    def die(self) -> None:
        for name in self.CALLS:
            setattr(self.executor, name, self._dead(name))

    @staticmethod
    def _dead(name: str):
        def call(*args, **kw):
            raise RankFailure(f"{name} failed on a rank: ActorDiedError")
        return call

    def restart(self) -> None:
        for name in self.CALLS:
            vars(self.executor).pop(name, None)
        rank = self.executor.rank
        for req_id in list(rank.backups):  # a new rank holds no backup
            rank.discard(req_id)


class Replica:
    """An in-process replica whose rank can be lost: its loop recovers as the coordinator's does
    (a new rank, every request rebuilt from its tokens), and its streams' items by request."""

    def __init__(self, name: str, **config):
        self.engine = make_engine(tiny_model(HYBRID), **config)
        self.rank = LostRank(self.engine.executor)
        self.recovered: list[Exception] = []
        self.loop = EngineLoop(self.engine, name, on_rank_failure=self._recover)
        self.aloop = asyncio.new_event_loop()
        threading.Thread(target=self.aloop.run_forever, daemon=True).start()
        self.items: dict[str, list[dict]] = {}

    def _recover(self, err: Exception) -> None:
        self.recovered.append(err)
        self.rank.restart()
        self.engine.reset_for_recovery()

    def start(self, *rids: str) -> None:
        """Submit `rids` and wait until each has streamed a few tokens."""
        sink = Sink(lambda batch: [self.items[rid].append(item) for rid, item in batch], self.aloop)
        for rid in rids:
            self.items[rid] = []
            self.loop.submit(rid, [1, 2, 3, 4, 5, 6], {"max_tokens": MAX_TOKENS, "ignore_eos": True}, sink)
        self.wait_for(lambda: all(self.tokens(rid) >= 3 for rid in rids), "the requests never ran")

    def settle(self) -> None:
        """Every batch the loop posted so far has been delivered: its items are in `items`. (The
        loop posts under its lock; the sink delivers later, on this replica's event loop.)"""
        done = threading.Event()
        self.aloop.call_soon_threadsafe(done.set)
        assert done.wait(30.0), "the replica's event loop never ran"

    def tokens(self, rid: str) -> int:
        return sum(len(i.get("token_ids", [])) for i in self.items[rid])

    def last(self, rid: str) -> dict | None:
        items = self.items[rid]
        return items[-1] if items and is_last(items[-1]) else None

    @staticmethod
    def wait_for(cond, what: str, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    def assert_served_whole(self, *rids: str) -> None:
        """Each of `rids` streamed to its end with every token it asked for: none was lost."""
        self.wait_for(lambda: all(self.last(rid) for rid in rids), "a stream never ended")
        for rid in rids:
            assert self.last(rid)["finish_reason"] == "length", (rid, self.last(rid))
            assert self.tokens(rid) == MAX_TOKENS, (rid, self.tokens(rid))

    def lose_rank_during(self, command):
        """`command()` while the rank is lost (no step in between): its answer, once the loop
        recovered the replica and lives on."""
        with self.loop.lock:
            self.rank.die()
            answer = command()
        assert len(self.recovered) == 1 and self.loop.thread.is_alive() and self.loop.healthy
        return answer

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.loop.shutdown()
        self.aloop.call_soon_threadsafe(self.aloop.stop)
        if exc[0] is None:
            assert_idle_clean(self.engine)


def test_a_rank_lost_during_an_operators_retraction_is_recovered_and_the_retraction_answers_ranks_failed():
    with Replica("retract-on-a-lost-rank", retraction_backup="cpu_tensor") as rep:
        rep.start("r0", "r1")
        retract = Retract(Selection(ids=("r0",)), mode="cpu_tensor", hold=True)
        assert rep.lose_rank_during(lambda: rep.loop.retract(retract)) == {"r0": Outcome.RANKS_FAILED}
        rep.assert_served_whole("r0", "r1")  # rebuilt from their tokens, then on to the end


def test_a_rank_lost_during_an_operators_resume_is_recovered_and_the_resume_answers_ranks_failed():
    with Replica("resume-on-a-lost-rank", retraction_backup="cpu_tensor") as rep:
        rep.start("r0", "r1")
        assert rep.loop.retract(Retract(Selection(ids=("r0",)), hold=True)) == {"r0": Outcome.CPU_TENSOR}
        resume = Resume(Selection(all=True))
        assert rep.lose_rank_during(lambda: rep.loop.resume(resume)) == {"r0": Outcome.RANKS_FAILED}
        assert rep.engine.requests["r0"].hold  # still held: its backup is gone, a resume recomputes it
        assert rep.loop.resume(Resume(Selection(ids=("r0",)))) == {"r0": Outcome.RECOMPUTE}
        rep.assert_served_whole("r0", "r1")


def test_a_rank_lost_while_an_abort_discards_a_backup_is_recovered_and_the_abort_answers():
    with Replica("abort-on-a-lost-rank", retraction_backup="cpu_tensor") as rep:
        rep.start("r0", "r1")
        assert rep.loop.retract(Retract(Selection(ids=("r0",)), hold=True)) == {"r0": Outcome.CPU_TENSOR}
        assert rep.lose_rank_during(lambda: rep.loop.abort("r0")) is True
        rep.wait_for(lambda: rep.last("r0"), "the aborted request's stream never ended")
        assert rep.last("r0")["finish_reason"] == "abort"
        rep.assert_served_whole("r1")


def test_a_rank_lost_during_the_invariant_check_is_recovered_and_the_check_answers_not_checked():
    with Replica("check-on-a-lost-rank") as rep:
        rep.start("r0")
        assert rep.lose_rank_during(rep.loop.check_invariants) is False  # not checked: its rank was lost
        rep.assert_served_whole("r0")
        assert rep.loop.check_invariants() is True


def _coordinators_recovery(engine, failing_raises: bool = False):
    """The Ray coordinator's recovery (its class's own `_recover`, on a stand-in) with its restarts
    used up: it fails every request, and reports itself down. `failing_raises`: failing them
    raises once (a bug there), and the loop gives up."""
    from types import SimpleNamespace

    from hyrax.actors.coordinator import RoleCoordinator
    from hyrax.actors.restart_budget import RestartBudget

    coord = SimpleNamespace(healthy=True, down=False, last_error=None, restarts=0, engine=engine,
                            restart_budget=RestartBudget(0, 600.0))
    fail_all = engine.fail_all

    def fail_all_with_a_bug(*args, **kw):
        engine.fail_all = fail_all  # once
        raise RuntimeError("a bug in failing the requests")
    if failing_raises:
        engine.fail_all = fail_all_with_a_bug
    coord.loop = EngineLoop(engine, "restarts-used-up",
                            on_rank_failure=lambda e: RoleCoordinator.__ray_metadata__.modified_class._recover(coord, e))
    return coord.loop


def _coordinators_recovery_whose_failing_raises(engine):
    return _coordinators_recovery(engine, failing_raises=True)


def _no_recovery_hook(engine):
    """An in-process replica (the gateway's LocalBackend): nothing replaces a lost rank."""
    return EngineLoop(engine, "no-recovery-hook")


@pytest.mark.parametrize("make_loop", [_coordinators_recovery, _coordinators_recovery_whose_failing_raises,
                                       _no_recovery_hook])
def test_a_replica_that_gave_up_ends_every_request_with_an_error_and_holds_no_pool_unit(make_loop):
    """A replica gives up when a lost rank cannot be replaced: its restarts are used up, or it has
    no recovery hook. When failing its requests raised too, or without a hook, its streams ended
    with the error, but the requests stayed in its table, running or retracted, holding their
    device pages and slots and their host-pool rows for good (the loop had stopped: nothing would
    ever free them). With its restarts used up, its requests ended with finish_reason "error" and
    no error: the gateway answered 200 with no text. Each ends with an error now (503: retry
    elsewhere), and every pool is free."""
    engine = make_engine(tiny_model(HYBRID), retraction_backup="cpu_tensor")
    loop = make_loop(engine)
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    items: dict[str, list[dict]] = {rid: [] for rid in ("r0", "r1", "r2", "r3")}
    sink = Sink(lambda batch: [items[rid].append(item) for rid, item in batch], aloop)
    try:
        for rid in items:
            loop.submit(rid, [1, 2, 3, 4, 5, 6], {"max_tokens": 400, "ignore_eos": True}, sink)
        Replica.wait_for(lambda: all(len(i) > 2 for i in items.values()), "the requests never ran")
        assert loop.retract(Retract(Selection(ids=("r0",)), mode="cpu_tensor", hold=True)) == {"r0": "cpu_tensor"}
        assert loop.retract(Retract(Selection(ids=("r1",)), mode="host_pool", hold=True)) == {"r1": "host_pool"}
        with loop.lock:
            LostRank(engine.executor).die()  # the next step finds it
        Replica.wait_for(lambda: all(i and is_last(i[-1]) for i in items.values()), "a stream never ended")
    finally:
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    for rid, stream in items.items():
        last = stream[-1]
        assert last["finish_reason"] == "error" and last.get("error") and last.get("status") == 503, (rid, last)
    assert not engine.requests, engine.counts()
    for a in list(engine.alloc.values()) + list(engine.host_alloc.values()):
        a.check()
        assert a.num_used == 0 and a.num_free == a.capacity, (a.name, engine.pool_usage())


# ---- a replica that went down ----------------------------------------------------------------

class CountedLostRank(LostRank):
    """A lost rank that counts the calls made to it (each would wait up to the rank timeout on a
    hung rank before it raised)."""

    def __init__(self, executor):
        super().__init__(executor)
        self.calls = 0

    def _dead(self, name: str):
        def call(*args, **kw):
            self.calls += 1
            raise RankFailure(f"{name} failed on a rank: GetTimeoutError")
        return call


def _down_coordinator(name: str):
    """The Ray coordinator's recovery (its class's own `_recover`, on a stand-in) with one restart
    in its budget, whose rank dies again at once after it: a request runs, the rank is lost, the
    restart brings up a rank that is lost too, and the replica goes down. (coordinator, its rank,
    the request's items)."""
    from types import SimpleNamespace

    from hyrax.actors.coordinator import RoleCoordinator
    from hyrax.actors.restart_budget import RestartBudget

    engine = make_engine(tiny_model(HYBRID))
    rank = CountedLostRank(engine.executor)
    coord = SimpleNamespace(healthy=True, down=False, last_error=None, restarts=0, engine=engine,
                            restart_budget=RestartBudget(1, 600.0), started=[])
    coord._start_ranks = lambda: coord.started.append(time.monotonic())  # the new rank is lost too
    coord.loop = EngineLoop(engine, name,
                            on_rank_failure=lambda e: RoleCoordinator.__ray_metadata__.modified_class._recover(coord, e))
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    items: dict[str, list[dict]] = {"r0": []}
    coord.submit = lambda rid: coord.loop.submit(rid, [1, 2, 3, 4, 5, 6], {"max_tokens": 400, "ignore_eos": True},
                                                 Sink(lambda batch: [items[r].append(i) for r, i in batch], aloop))
    coord.aloop = aloop
    coord.submit("r0")
    Replica.wait_for(lambda: len(items["r0"]) > 2, "the request never ran")
    with coord.loop.lock:
        rank.die()
    Replica.wait_for(lambda: items["r0"] and is_last(items["r0"][-1]), "the request never ended")
    assert coord.down and len(coord.started) == 1, vars(coord)
    return coord, rank, items


def _close(coord) -> None:
    coord.loop.shutdown()
    coord.aloop.call_soon_threadsafe(coord.aloop.stop)


def test_a_replica_that_went_down_refuses_a_new_request_at_once_without_calling_its_ranks():
    """A replica whose restarts were used up reports itself down and ends its requests, and the
    controller replaces it. Meanwhile it took new requests: each was admitted and waited for a step
    to reach the dead ranks (up to the rank timeout) before it failed. It refuses them at once now,
    with a retryable error (503: the gateway answers Retry-After), and calls no rank."""
    from hyrax.actors.coordinator import DOWN

    coord, rank, items = _down_coordinator("down-refuses")
    try:
        assert items["r0"][-1]["error"] == DOWN and items["r0"][-1]["status"] == 503
        calls, steps = rank.calls, coord.engine.stats.steps
        items["later"] = []
        coord.submit("later")
        Replica.wait_for(lambda: items["later"] and is_last(items["later"][-1]), "a later request was never answered")
        [refused] = items["later"]
        assert refused["error"] == DOWN and refused["status"] == 503, refused
        assert is_refusal(refused)  # never admitted: the gateway sends it to another replica
        assert rank.calls == calls and coord.engine.stats.steps == steps  # no step, no rank call
        assert coord.down and not coord.healthy  # what the gateways route by and the controller replaces
    finally:
        _close(coord)
    assert not coord.engine.requests


def test_a_replica_that_went_down_stays_down_after_its_restart_window_passes():
    """Down is final: the controller replaces a replica that says it is down. Once its restart
    window (600 s) had passed, the budget allowed restarts again, and a rank failure seen by a
    down replica (its idle pool check asked the dead ranks for their backups) restarted its ranks,
    racing the replacement the controller had placed, and cleared `down`. Now its closed loop calls
    no rank (an operator's command answers at once: the invariant check, not checked) and its
    recovery restarts nothing, whatever its budget says."""
    from hyrax.actors.coordinator import RESTART_WINDOW_S, RoleCoordinator

    coord, rank, items = _down_coordinator("down-stays-down")
    try:
        budget = coord.restart_budget
        budget._at = [t - RESTART_WINDOW_S for t in budget._at]  # the window has passed
        calls = rank.calls
        time.sleep(3 * coord.loop.idle_check_after_s)  # long enough for an idle check of the pools
        assert coord.loop.check_invariants() is False  # not checked: its ranks are gone
        RoleCoordinator.__ray_metadata__.modified_class._recover(coord, RankFailure("a later failure"))
        assert len(coord.started) == 1 and coord.down and not coord.healthy, vars(coord)
        assert rank.calls == calls
    finally:
        _close(coord)


# ---- a rank lost while a state move saves or loads ----------------------------------------------

def _save_fails_on_a_rank(rep: Replica) -> None:
    """The rank timed out on a save (it answers a discard): the ranks' state is suspect."""
    def save(*args, **kw):
        raise RankFailure("save failed on a rank: GetTimeoutError")
    rep.engine.executor.save = save  # the recovery's restart brings a rank that saves


def test_a_rank_lost_during_an_operators_save_is_recovered_not_taken_for_a_failed_save():
    """A retraction's save that failed on a rank was taken as a save that failed on a live rank:
    the request was retracted by recompute (its state dropped), the answer said `recompute`, and the
    lost rank stayed for the next step to find. It is recovered at once now, the answer is
    ranks_failed, and the request (not retracted, not held) runs on, rebuilt from its tokens."""
    with Replica("save-on-a-lost-rank", retraction_backup="cpu_tensor") as rep:
        rep.start("r0", "r1")
        with rep.loop.lock:
            _save_fails_on_a_rank(rep)
            answer = rep.loop.retract(Retract(Selection(ids=("r0",)), mode="cpu_tensor", hold=True))
        assert answer == {"r0": Outcome.RANKS_FAILED} and len(rep.recovered) == 1, (answer, rep.recovered)
        assert rep.engine.requests["r0"].state != State.RETRACTED
        rep.assert_served_whole("r0", "r1")


def test_a_rank_lost_during_a_forced_retractions_save_in_a_step_is_recovered():
    with Replica("forced-save-on-a-lost-rank", retraction_backup="cpu_tensor") as rep:
        rep.start("r0", "r1")
        with rep.loop.lock:
            _save_fails_on_a_rank(rep)
            rep.loop.set_forced_retraction(1)
        Replica.wait_for(lambda: rep.recovered, "the lost rank was never recovered")
        rep.loop.set_forced_retraction(0)
        assert rep.engine.stats.retractions[("forced", "recompute")] == 0, rep.engine.stats.retractions
        rep.assert_served_whole("r0", "r1")


def test_a_rank_lost_while_an_import_loads_is_recovered_and_the_request_goes_on_once():
    """An import whose load failed on a rank was taken as a failed copy: the request was rebuilt
    by prefill (answer `fallback`) on the lost rank, found only by the next step. The replica
    recovers at once now; the request stays its own (acknowledged to its source, whose offer is
    freed), is rebuilt from its tokens and streams each of its tokens once."""
    source = make_engine(tiny_model(HYBRID))
    source.add_request([1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), "m0")
    while len(source.requests["m0"].output_ids) < 3:
        source.step()
    before = len(source.requests["m0"].output_ids)
    handoff = source.export_running("m0")
    source_loop = EngineLoop(source, "import-source")
    try:
        with Replica("import-on-a-lost-rank") as rep:
            def load(*args, **kw):
                raise RankFailure("load failed on a rank: ActorDiedError")
            rep.items["m0"] = []
            sink = Sink(lambda batch: [rep.items[rid].append(item) for rid, item in batch], rep.aloop)
            with rep.loop.lock:
                rep.engine.executor.load = load  # the recovery's restart brings a rank that loads
                rep.loop.submit_imported(dict(handoff, source=source_loop), sink)
            rep.wait_for(lambda: rep.last("m0"), "the imported request never ended")
            assert rep.items["m0"][0]["imported"] == Outcome.RANKS_FAILED and len(rep.recovered) == 1
            assert rep.last("m0")["finish_reason"] == "length" and rep.tokens("m0") == MAX_TOKENS - before
            assert dict(rep.engine.stats.transfers_in) == {"ranks_failed": 1}  # counted as it was answered
        Replica.wait_for(lambda: "m0" not in source.requests, "the source's offer was never acknowledged")
        assert source.stats.transfers_out == 1
    finally:
        source_loop.shutdown()
    assert_idle_clean(source)


def test_a_resume_whose_load_hits_a_lost_rank_leaves_the_request_held():
    """A resume let go of the operator's hold before the load failed on a lost rank: the answer
    said ranks_failed, yet the recovery rebuilt the request and it ran. It is held now, as if the
    resume had never been asked for, until the operator resumes it again."""
    with Replica("resume-held-on-a-lost-rank", retraction_backup="cpu_tensor") as rep:
        rep.start("r0", "r1")
        assert rep.loop.retract(Retract(Selection(ids=("r0",)), hold=True)) == {"r0": Outcome.CPU_TENSOR}
        resume = Resume(Selection(ids=("r0",)))
        assert rep.lose_rank_during(lambda: rep.loop.resume(resume)) == {"r0": Outcome.RANKS_FAILED}
        req = rep.engine.requests["r0"]
        assert req.state == State.RETRACTED and req.hold, (req.state, req.hold)
        rep.settle()  # the tokens streamed before the retraction may still be on their way
        tokens = rep.tokens("r0")
        rep.assert_served_whole("r1")
        assert rep.tokens("r0") == tokens and rep.last("r0") is None  # it did not run meanwhile
        assert rep.loop.resume(resume) == {"r0": Outcome.RECOMPUTE}  # its backup went with the rank
        rep.assert_served_whole("r0")


# ---- a rank lost part way through an operator's list of requests --------------------------------

def _fails_for(rep: Replica, call: str, req_id: str) -> None:
    """The executor's `call` (save or load) fails on a rank for `req_id` only; the others before
    it in the same command go through. The recovery's restart brings a rank that works."""
    works = getattr(rep.engine.executor, call)

    def move(rid, *args, **kw):
        if rid == req_id:
            raise RankFailure(f"{call} failed on a rank: ActorDiedError")
        return works(rid, *args, **kw)
    setattr(rep.engine.executor, call, move)


def test_a_retraction_of_several_requests_that_loses_a_rank_part_way_answers_each_as_it_was_left():
    """r0 was saved and retracted with the hold asked for, then the rank was lost saving r1. Both
    answered ranks_failed, the answer that means 'not retracted, runs on', yet r0 stayed retracted
    and held (the recovery keeps a held request held): an operator told the retraction failed had
    no reason to resume it, and it waited for good. Each answer now says what became of it: r0 is
    retracted and held with its state gone with the rank (recompute: a resume rebuilds it), r1 was
    not retracted and runs on."""
    with Replica("retract-list-on-a-lost-rank", retraction_backup="cpu_tensor") as rep:
        rep.start("r0", "r1")
        retract = Retract(Selection(ids=("r0", "r1")), mode="cpu_tensor", hold=True)
        with rep.loop.lock:
            _fails_for(rep, "save", "r1")
            answer = rep.loop.retract(retract)
        assert len(rep.recovered) == 1, rep.recovered
        r0 = rep.engine.requests["r0"]
        assert r0.state == State.RETRACTED and r0.hold, (r0.state, r0.hold)
        assert answer == {"r0": Outcome.RECOMPUTE, "r1": Outcome.RANKS_FAILED}, answer
        assert rep.engine.requests["r1"].state != State.RETRACTED
        rep.assert_served_whole("r1")
        assert rep.loop.resume(Resume(Selection(ids=("r0",)))) == {"r0": Outcome.RECOMPUTE}
        rep.assert_served_whole("r0")


def test_a_resume_of_several_requests_that_loses_a_rank_part_way_answers_each_as_it_was_left():
    """r0 was restored, then the rank was lost loading r1. Both answered ranks_failed, which
    for a resume means 'still held: resume it again', yet r0 was no longer held and ran (rebuilt
    by the recovery). Now r0 answers recompute (resumed, rebuilt from its tokens) and r1
    ranks_failed (still held)."""
    with Replica("resume-list-on-a-lost-rank", retraction_backup="cpu_tensor") as rep:
        rep.start("r0", "r1")
        both = Selection(ids=("r0", "r1"))
        assert rep.loop.retract(Retract(both, hold=True)) == {"r0": Outcome.CPU_TENSOR, "r1": Outcome.CPU_TENSOR}
        with rep.loop.lock:
            _fails_for(rep, "load", "r1")
            answer = rep.loop.resume(Resume(both))
        assert len(rep.recovered) == 1, rep.recovered
        r1 = rep.engine.requests["r1"]
        assert r1.state == State.RETRACTED and r1.hold, (r1.state, r1.hold)
        assert answer == {"r0": Outcome.RECOMPUTE, "r1": Outcome.RANKS_FAILED}, answer
        rep.assert_served_whole("r0")
        assert rep.loop.resume(Resume(Selection(ids=("r1",)))) == {"r1": Outcome.RECOMPUTE}
        rep.assert_served_whole("r1")
