"""The Ray coordinator's own methods, run without Ray: the actor's class (undecorated) is called
on a stand-in `self` that carries only what the method reads."""
from __future__ import annotations

import asyncio
import threading
import time
from types import SimpleNamespace

from engine_helpers import HYBRID, assert_idle_clean, greedy, make_engine, tiny_model
from hyrax.actors.coordinator import RoleCoordinator
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.request import State
from hyrax.actors.engine.step_feed import Sink, is_last

Coordinator = RoleCoordinator.__ray_metadata__.modified_class


def _wait_for(cond, what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _offered(engine, rid: str) -> dict:
    """`rid` run to its third token on `engine`, then offered (a migration's export)."""
    engine.add_request([1, 2, 3, 4, 5, 6], greedy(max_tokens=40, ignore_eos=True), rid)
    while len(engine.requests[rid].output_ids) < 3:
        engine.step()
    handoff = engine.export_running(rid)
    assert handoff is not None and engine.requests[rid].state == State.OFFERED
    return handoff


def test_an_acknowledgement_never_waits_for_the_step_loop():
    """`release` (an importer's acknowledgement) runs on the coordinator's event loop, the loop
    that also answers health checks, takes gateway lease renewals and streams every feed. It
    used to take the engine loop's lock there: while the loop thread held it for long (a
    recovery restarting the ranks holds it for the whole restart), the event loop stood
    still - no health answer (the controller kills a replica silent for --hung-replica-timeout)
    and no lease renewal (the lease thread then aborted every gateway's streams). It is queued
    now, ahead of whatever arrives after it, and applied by the loop at its next turn."""
    home = make_engine(tiny_model(HYBRID))
    _offered(home, "m0")
    home_loop = EngineLoop(home, "home")
    coord = SimpleNamespace(loop=home_loop)
    try:
        held = threading.Event()
        let_go = threading.Event()

        def long_turn():  # a step (or a recovery) that holds the loop's lock for a while
            with home_loop.lock:
                held.set()
                let_go.wait(3)
        threading.Thread(target=long_turn, daemon=True).start()
        assert held.wait(5)
        t0 = time.monotonic()
        Coordinator.release(coord, "m0")
        waited = time.monotonic() - t0
        let_go.set()
        assert waited < 1.0, f"release waited {waited:.1f} s for the step loop's lock"
        _wait_for(lambda: "m0" not in home.requests, "the acknowledged offer was never freed")
        assert home.stats.transfers_out == 1
    finally:
        let_go.set()
        home_loop.shutdown()
    assert_idle_clean(home)


def test_a_request_migrated_away_and_back_is_imported_after_its_first_offer_is_released():
    """The release is applied in arrival order with the streams: an import of the same id that
    arrives after the acknowledgement (the request migrated away and back) finds the id free."""
    home, away = make_engine(tiny_model(HYBRID)), make_engine(tiny_model(HYBRID))
    first = _offered(home, "m1")
    away.import_request(first)
    while len(away.requests["m1"].output_ids) < 6:
        away.step()
    back = dict(away.export_running("m1"), source=None)
    home_loop = EngineLoop(home, "home-back")
    coord = SimpleNamespace(loop=home_loop)
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    items: list[dict] = []
    try:
        with home_loop.lock:  # both arrive while a step runs
            Coordinator.release(coord, "m1")
            home_loop.submit_imported(back, Sink(lambda batch: items.extend(i for _, i in batch), aloop))
        _wait_for(lambda: items and is_last(items[-1]), "the stream that came back never ended")
        assert "error" not in items[0], items[0]
        assert items[-1]["finish_reason"] == "length"
    finally:
        home_loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    away.release_handoff("m1")
    assert_idle_clean(home)
    assert_idle_clean(away)


def _method_globals(fn) -> dict:
    """The globals of an actor class's method: under Ray's tracing wrapper (which keeps the
    method in its closure), the method's own."""
    while True:
        inner = getattr(fn, "__wrapped__", None) or next(
            (c.cell_contents for c in (fn.__closure__ or ()) if callable(c.cell_contents)
             and getattr(c.cell_contents, "__name__", None) == fn.__name__), None)
        if inner is None:
            return fn.__globals__
        fn = inner


class _Cluster:
    """Just enough of Ray for `_start_ranks`: named rank actors (a name is taken while its actor
    lives, as in Ray), calls that answer at once, and a setup that fails while `failing`."""

    def __init__(self):
        self.live: dict[str, object] = {}  # actor name -> handle
        self.failing = False
        self.kill = self._kill

    def options(self, name: str, **_):
        if name in self.live:
            raise ValueError(f"The name {name} (namespace=hyrax) is already taken.")
        cluster = self

        class Rank:
            def __init__(self):
                self.name = name
                self.dist_address = SimpleNamespace(remote=lambda: "127.0.0.1:1")
                self.setup = SimpleNamespace(remote=self._setup)

            def _setup(self, *_):
                if cluster.failing:
                    return TimeoutError("setup did not answer within the rank timeout")
                return {"device": "cpu", "attention_backend": "reference", "dtype": "float32", "heap": {}}

        def remote(*_):
            rank = cluster.live[name] = Rank()
            return rank
        return SimpleNamespace(remote=remote)

    def get(self, refs, timeout=None):
        out = refs if isinstance(refs, list) else [refs]
        for r in out:
            if isinstance(r, Exception):
                raise r
        return refs

    def cluster_resources(self) -> dict:
        return {"CPU": 2.0}  # no GPU

    def _kill(self, actor, no_restart=True):
        if self.live.get(actor.name) is actor:
            del self.live[actor.name]


def test_ranks_that_failed_to_start_are_stopped_and_the_next_restart_can_take_their_names(monkeypatch):
    """A rank restart (after a rank failure) whose new ranks failed to set up (a setup that timed
    out, a rank that raised) left those ranks running: they kept their actor names and their
    placement group bundles, so every later restart failed at once ('name already taken'), and
    the replica gave up, though the next try could have started."""
    cluster = _Cluster()
    # the globals _start_ranks reads (the module's; a copy of them where Ray re-made the actor
    # class in this process, which a whole-suite run does: patching the module alone missed them)
    names = _method_globals(Coordinator._start_ranks)
    monkeypatch.setitem(names, "ray", cluster)
    monkeypatch.setitem(names, "RankWorker", cluster)
    monkeypatch.setitem(names, "_cuda_cluster", lambda: False)
    coord = Coordinator.__new__(Coordinator)
    coord.role, coord.replica, coord.namespace, coord.tp_size, coord.pg = "decode", 0, "hyrax", 2, None
    coord.model_dir, coord.rank_timeout_s, coord.ranks = "model", 1.0, []
    coord.config = SimpleNamespace(gpu_memory_fraction=None)
    coord._start_ranks()  # the replica's first ranks
    cluster.failing = True
    try:
        coord._start_ranks()  # a restart whose ranks do not come up
    except TimeoutError:
        pass
    else:
        raise AssertionError("the failed setup was not raised")
    assert cluster.live == {}, f"ranks of the failed start still run: {sorted(cluster.live)}"
    cluster.failing = False
    coord._start_ranks()  # the next try
    assert sorted(cluster.live) == ["hyrax/decode/0/rank0", "hyrax/decode/0/rank1"]
    assert [r.name for r in coord.ranks] == sorted(cluster.live) and coord.healthy


def test_a_lapsed_gateways_request_whose_backup_cannot_be_discarded_still_ends_and_leases_go_on():
    """A gateway's lease ran out while one of its requests sat retracted with its backup in rank
    memory, and the rank holding it had died: the abort's discard raised RankFailure. The finish
    was never recorded (the stream waited forever for its last item), and the error ended the
    coordinator's lease thread: no lapsed gateway's streams were aborted any more."""
    from hyrax.actors.engine.commands import Retract
    from hyrax.actors.engine.executor import RankFailure
    from hyrax.actors.engine.gateway_leases import LEASE_EXPIRED, GatewayLeases
    from hyrax.actors.engine.selection import Selection

    engine = make_engine(tiny_model(HYBRID), retraction_backup="cpu_tensor")
    recovered: list[Exception] = []

    def recover(err):  # the coordinator's: a new rank (whose discard works), every request rebuilt
        recovered.append(err)
        vars(engine.executor).pop("discard", None)
        engine.reset_for_recovery()
    loop = EngineLoop(engine, "lapsed", on_rank_failure=recover)
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    items: dict[str, list] = {"r0": [], "r1": []}
    sink = Sink(lambda batch: [items[rid].append(item) for rid, item in batch], aloop)
    coord = SimpleNamespace(loop=loop, gateways=GatewayLeases(),
                            feeds=SimpleNamespace(close_gateway_soon=lambda gateway: None))
    try:
        for rid in items:
            loop.submit(rid, [1, 2, 3, 4, 5, 6], {"max_tokens": 400, "ignore_eos": True}, sink)
        _wait_for(lambda: all(len(i) > 2 for i in items.values()), "the requests never ran")
        assert loop.retract(Retract(Selection(ids=("r0",)), mode="cpu_tensor", hold=True)) == {"r0": "cpu_tensor"}

        def discard(req_id):
            raise RankFailure("discard failed on a rank: ActorDiedError")
        engine.executor.discard = discard
        lapse = threading.Thread(target=Coordinator._expire_gateways, args=(coord,), daemon=True)
        lapse.start()
        coord.gateways.open("gw-a", "r0")
        coord.gateways.renew("gw-a", 0.0)
        _wait_for(lambda: items["r0"] and is_last(items["r0"][-1]), "the retracted request's stream never ended")
        assert items["r0"][-1]["finish_reason"] == "abort" and items["r0"][-1]["error"] == LEASE_EXPIRED
        assert len(recovered) == 1 and not is_last(items["r1"][-1])  # the lost rank was replaced; r1 runs on
        coord.gateways.open("gw-b", "r1")
        coord.gateways.renew("gw-b", 0.0)
        _wait_for(lambda: is_last(items["r1"][-1]), "a later lapsed gateway's stream was never aborted")
        assert items["r1"][-1]["finish_reason"] == "abort" and lapse.is_alive()
    finally:
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
    assert not engine.has_unfinished()


def test_a_recovery_that_raises_ends_every_stream_and_the_replica_reports_down():
    """A rank failed, its restarts were used up, and failing the requests raised (an engine bug
    there): the error escaped the loop's guard and ended the loop thread. Every stream of the
    replica then waited forever, later requests were queued and never run, and the replica never
    said it was down (the controller replaces only a replica that does). Now its streams end with
    the error, later ones are refused, and it reports itself down."""
    from hyrax.actors.engine.executor import RankFailure
    from hyrax.actors.restart_budget import RestartBudget

    engine = make_engine(tiny_model(HYBRID))
    coord = SimpleNamespace(healthy=True, down=False, last_error=None, restarts=0, engine=engine,
                            restart_budget=RestartBudget(0, 600.0))
    loop = coord.loop = EngineLoop(engine, "recovery-raises", on_rank_failure=lambda e: Coordinator._recover(coord, e))
    step, fail_all = engine.step, engine.fail_all

    def step_then_lose_a_rank():
        if engine.stats.finished or any(len(r.output_ids) >= 3 for r in engine.running):
            raise RankFailure("execute failed on a rank: ActorDiedError")
        return step()

    def fail_all_with_a_bug(*args, **kw):
        engine.fail_all = fail_all  # once
        raise RuntimeError("a bug in failing the requests")
    engine.step, engine.fail_all = step_then_lose_a_rank, fail_all_with_a_bug
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    items: dict[str, list] = {"r0": [], "later": []}
    sink = Sink(lambda batch: [items[rid].append(item) for rid, item in batch], aloop)
    try:
        loop.submit("r0", [1, 2, 3, 4, 5, 6], {"max_tokens": 40, "ignore_eos": True}, sink)
        _wait_for(lambda: items["r0"] and is_last(items["r0"][-1]), "the stream of the failed replica never ended")
        assert "error" in items["r0"][-1], items["r0"][-1]
        assert coord.down and not coord.healthy and not loop.healthy
        loop.submit("later", [1, 2, 3], {"max_tokens": 4}, sink)
        _wait_for(lambda: items["later"] and is_last(items["later"][-1]), "a later request was never answered")
        assert "error" in items["later"][-1], items["later"][-1]
    finally:
        loop.shutdown()
        aloop.call_soon_threadsafe(aloop.stop)
