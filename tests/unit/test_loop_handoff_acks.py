"""Two in-process loops hand requests to each other (bench/prefix.py, the in-process PD path):
the importer acknowledges to the source loop while its own loop thread holds its own lock."""
from __future__ import annotations

import asyncio
import threading
import time

from engine_helpers import HYBRID, assert_idle_clean, greedy, make_engine, tiny_model
from hyrax.actors.engine.loop import EngineLoop
from hyrax.actors.engine.request import State
from hyrax.actors.engine.step_feed import Sink


def _offer(loop: EngineLoop, rid: str) -> dict:
    """`rid` run to its third token on `loop`'s engine, then offered with `loop` as its source."""
    engine = loop.engine
    with loop.lock:
        engine.add_request([1, 2, 3, 4, 5, 6], greedy(max_tokens=40, ignore_eos=True), rid)
        while len(engine.requests[rid].output_ids) < 3:
            engine.step()
        handoff = engine.export_running(rid)
        engine.step_outputs_flush()
    assert handoff is not None and engine.requests[rid].state == State.OFFERED
    return dict(handoff, source=loop)


def test_two_loops_importing_from_each_other_at_once_do_not_deadlock():
    """The acknowledgement took the source loop's lock from the importer's loop thread, which
    holds its own: two loops importing from each other at the same moment each waited for the
    other's lock for good, and every stream of both replicas hung. Both imports here finish
    admitting at the same moment (a barrier), then acknowledge."""
    a = EngineLoop(make_engine(tiny_model(HYBRID)), "a")
    b = EngineLoop(make_engine(tiny_model(HYBRID)), "b")
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    firsts: dict[str, dict] = {}
    try:
        to_b, to_a = _offer(a, "from-a"), _offer(b, "from-b")
        both = threading.Barrier(2, timeout=5)
        for loop in (a, b):
            inner = loop.engine.import_request

            def import_then_wait(handoff, *more, inner=inner):
                out = inner(handoff, *more)
                both.wait()  # each loop thread holds its own lock here
                return out
            loop.engine.import_request = import_then_wait
        sink = Sink(lambda batch: [firsts.setdefault(rid, item) for rid, item in batch], aloop)
        a.submit_imported(to_a, sink)
        b.submit_imported(to_b, sink)
        deadline = time.monotonic() + 10
        while len(firsts) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(firsts) == ["from-a", "from-b"], f"the imports never answered: {sorted(firsts)} (deadlock)"
        assert all(item.get("imported") == "verified" for item in firsts.values()), firsts
        for loop, rid in ((a, "from-a"), (b, "from-b")):  # each source freed its offer
            deadline = time.monotonic() + 10
            while rid in loop.engine.requests or loop.engine.has_unfinished():
                assert time.monotonic() < deadline, f"{rid} was never released at its source"
                time.sleep(0.01)
    finally:
        aloop.call_soon_threadsafe(aloop.stop)
        a.shutdown()
        b.shutdown()
    assert_idle_clean(a.engine)
    assert_idle_clean(b.engine)


def test_a_rank_lost_during_a_migrations_export_is_recovered_and_the_request_can_move_later():
    """A rank died while a running request was exported for a migration: the export raised out
    of the admin command (outside the loop's guard), the gateway kept the request marked as on
    its way (every later migration of it answered "not running" until it ended), and the rank
    was left for the next step to find. Now the failure is recovered at once, as in a step: the
    migration answers that the request is not running (it is being rebuilt), its stream goes on,
    and a later migration moves it."""
    from hyrax.actors.engine.executor import RankFailure
    from hyrax.api.client import EngineClient, LocalBackend, ModelInfo

    model = tiny_model(HYBRID)
    recovered: list[Exception] = []

    def recover(engine):
        return lambda e: (recovered.append(e), engine.reset_for_recovery())
    engines = [make_engine(model, deterministic=False, prefix_cache=False) for _ in range(2)]
    loops = [EngineLoop(e, f"m{k}", on_rank_failure=recover(e)) for k, e in enumerate(engines)]
    executor = engines[0].executor
    save = executor.save

    def save_on_a_dead_rank(*args, **kw):
        executor.save = save  # once
        raise RankFailure("save failed on a rank: ActorDiedError")
    source, target = LocalBackend(loops[0], "colocated", 0), LocalBackend(loops[1], "colocated", 1)
    client = EngineClient(ModelInfo("t", 4096, None, None, 96), [source, target], cache_route_margin=None)

    async def scenario():
        items = []

        async def consume():
            async for item in client.generate("r1", [5, 6, 7, 8], {"max_tokens": 60, "ignore_eos": True}):
                items.append(item)

        def tokens():
            return sum(len(i.get("token_ids", [])) for i in items)
        task = asyncio.ensure_future(consume())
        while tokens() < 3:
            await asyncio.sleep(0.005)
        executor.save = save_on_a_dead_rank
        outcome, _ = await client.migrate("r1", target)
        assert outcome.value == "not_running" and len(recovered) == 1, (outcome, recovered)
        seen = tokens()
        while tokens() < seen + 3:  # rebuilt and running again at the source
            await asyncio.sleep(0.005)
        outcome, _ = await client.migrate("r1", target)
        assert outcome.value == "migrating", outcome
        await asyncio.wait_for(task, 60)
        return items

    try:
        items = asyncio.run(scenario())
        assert items[-1]["finish_reason"] == "length", items[-1]
        assert sum(len(i.get("token_ids", [])) for i in items) == 60
        for loop in loops:
            deadline = time.monotonic() + 10
            while not loop.is_idle_clean():
                assert time.monotonic() < deadline, f"{loop.engine.counts()}"
                time.sleep(0.01)
    finally:
        for loop in loops:
            loop.shutdown()


def test_an_acknowledgement_that_raises_does_not_end_the_loop_thread():
    """An acknowledgement queued by `release_soon` is applied when the loop opens the queued
    streams, outside the guard around steps: an error in freeing the offer (an engine bug) ended
    the loop thread, and every later request of the replica waited forever."""
    loop = EngineLoop(make_engine(tiny_model(HYBRID)), "ack-raises")
    aloop = asyncio.new_event_loop()
    threading.Thread(target=aloop.run_forever, daemon=True).start()
    last: dict[str, dict] = {}
    try:
        _offer(loop, "m0")
        release, raised = loop.engine.release_handoff, []

        def release_with_a_bug(rid):
            loop.engine.release_handoff = release  # once
            raised.append(rid)
            raise RuntimeError("a bug in freeing an offer")
        loop.engine.release_handoff = release_with_a_bug
        loop.release_soon("m0")
        deadline = time.monotonic() + 10
        while not raised:
            assert time.monotonic() < deadline, "the acknowledgement was never applied"
            time.sleep(0.01)
        sink = Sink(lambda batch: [last.__setitem__(rid, item) for rid, item in batch if item["finished"]], aloop)
        loop.submit("after", [1, 2, 3, 4, 5], {"max_tokens": 3, "ignore_eos": True}, sink)
        deadline = time.monotonic() + 10
        while "after" not in last:
            assert time.monotonic() < deadline, f"the next request never ended (loop thread alive: {loop.thread.is_alive()})"
            time.sleep(0.01)
        assert last["after"]["finish_reason"] == "length", last["after"]
        assert "a bug in freeing an offer" in loop.last_error
    finally:
        aloop.call_soon_threadsafe(aloop.stop)
        loop.shutdown()
    assert_idle_clean(loop.engine)
