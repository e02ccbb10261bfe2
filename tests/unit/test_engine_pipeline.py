"""The request table's transition rules, and the pipeline's one free point: under overlap
scheduling no index is given back while a submitted step may still write it (issue 14
item 8: a request finishing on EOS had its pages and slot freed while step N+1, already
submitted, still wrote them)."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import (
    HYBRID, assert_idle_clean, greedy, make_engine, make_prompts, reference_outputs, run_requests, tiny_model,
)
from hyrax.actors.engine.local import run_to_completion
from hyrax.actors.engine.lifecycle import IllegalTransition, Outcome, RequestTable
from hyrax.actors.engine.request import Request, SamplingParams, State


class InflightSpy:
    """Wraps an engine's executor and allocators: records what each submitted step
    references until it is collected, and fails any free of an index such a step holds."""

    def __init__(self, engine):
        self.inner, self.inflight, self.violations = engine.executor, {}, []
        engine.executor = self
        for name, alloc in engine.alloc.items():
            alloc.free = self._checked(name, alloc.free)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def submit(self, plan):
        refs = {}
        for e in plan.all_entries():  # the decode block's rows too
            for name, table in e.page_tables.items():
                refs.setdefault(name, set()).update(p for p in table if p >= 0)
            for name, slot in e.slots.items():
                refs.setdefault(name, set()).add(slot)
        handle = self.inner.submit(plan)
        self.inflight[id(handle)] = (plan.step, refs)
        return handle

    def collect(self, handle):
        self.inflight.pop(id(handle), None)
        return self.inner.collect(handle)

    def _checked(self, name, free):
        def spy(owner, indices):
            for step, refs in self.inflight.values():
                hit = set(indices) & refs.get(name, set())
                if hit:
                    self.violations.append((name, owner, sorted(hit), step))
            return free(owner, indices)
        return spy


def _stop_on_third_token(model, prompts):
    """Per prompt, the greedy token it produces third: used as its stop token, so requests
    end on "EOS" mid-run, where the scheduler could not know they would."""
    outs = run_requests(make_engine(model), prompts, greedy())
    return [greedy(stop_token_ids=(o[2],)) for o in outs]


@pytest.mark.parametrize("overlap", [True, False])
def test_no_index_is_freed_while_a_submitted_step_still_references_it(overlap):
    model = tiny_model(HYBRID)
    prompts = make_prompts(8, seed=5)
    params = _stop_on_third_token(model, prompts)
    engine = make_engine(model, overlap=overlap, deterministic=False)
    spy = InflightSpy(engine)
    outs = run_requests(engine, prompts, params)
    assert spy.violations == [], spy.violations[:5]
    assert all(o[-1] in p.stop_token_ids for o, p in zip(outs, params))
    assert engine.stats.finished["stop"] == len(prompts)
    assert_idle_clean(engine)


def test_an_abort_under_overlap_frees_after_the_step_in_flight():
    model = tiny_model(HYBRID)
    engine = make_engine(model, overlap=True, deterministic=False)
    spy = InflightSpy(engine)
    ids = [engine.add_request(p, greedy(max_tokens=30)) for p in make_prompts(4, seed=6)]
    for _ in range(6):
        engine.step()
    assert engine.has_inflight()
    for rid in ids:
        assert engine.abort(rid)
    for _ in range(3):
        engine.step()
    assert spy.violations == []
    assert_idle_clean(engine)


# ---- the request table ---------------------------------------------------------------------
def _req(rid="r"):
    return Request(rid, [1, 2, 3], SamplingParams(), seed=0)


def test_the_table_walks_the_legal_lifecycle_and_keeps_each_request_in_one_list():
    t = RequestTable()
    r = _req()
    t.admit(r)
    assert r.state == State.WAITING and t.waiting == [r]
    t.start(r)
    t.retract(r, hold=True)
    assert r.state == State.RETRACTED and r.hold and r.retractions == 1 and t.retracted == [r]
    t.restore(r)
    assert r.state == State.RUNNING and not r.hold and t.running == [r]
    t.offer(r, lease_s=5.0)
    assert r.state == State.OFFERED and t.offered == {"r": r} and not t.running
    assert t.expired_offers(r.offer_deadline - 1) == [] and t.expired_offers(r.offer_deadline) == [r]
    assert t.finish(r, "transferred") == State.OFFERED
    assert r.state == State.FINISHED and len(t) == 0 and not t.offered


@pytest.mark.parametrize("setup,move", [
    ((), "start"),  # not in the table
    (("admit",), "retract"),  # waiting is not running
    (("admit",), "restore"),
    (("admit",), "offer"),
    (("admit", "start"), "restore"),  # running is not retracted
    (("admit", "start", "retract"), "offer"),
    (("admit", "start"), "admit"),  # the same id twice
])
def test_illegal_transitions_raise(setup, move):
    t, r = RequestTable(), _req()
    args = {"retract": (False,), "offer": (1.0,)}
    for step in setup:
        getattr(t, step)(r, *args.get(step, ()))
    before = (r.state, list(t.waiting), list(t.running), list(t.retracted))
    with pytest.raises(IllegalTransition):
        getattr(t, move)(r, *args.get(move, ()))
    assert (r.state, list(t.waiting), list(t.running), list(t.retracted)) == before


def test_finishing_twice_raises_and_requeue_puts_a_request_first_in_line():
    t = RequestTable()
    a, b = _req("a"), _req("b")
    t.admit(a)
    t.admit(b)
    t.start(b)
    t.requeue(b)
    assert t.waiting == [b, a]
    t.finish(a, "abort")
    with pytest.raises(IllegalTransition):
        t.finish(a, "abort")


def test_outcomes_are_typed_and_refusals_are_not_ok():
    assert Outcome.VERIFIED == "verified" and Outcome.VERIFIED.ok
    assert not Outcome.UNKNOWN.ok and not Outcome.NOT_RUNNING.ok and Outcome.QUEUED.ok


# ---- offers under a lease ------------------------------------------------------------------
def _offered(model):
    engine = make_engine(model, role="prefill", offer_lease_s=2.0)
    rid = engine.add_request(make_prompts(1, seed=7)[0], greedy())
    handoffs = []
    for _ in range(50):
        handoffs += [o.handoff for o in engine.step() if o.handoff is not None]
        if handoffs:
            break
    assert handoffs and engine.requests[rid].state == State.OFFERED
    assert not engine.is_idle_clean()  # its state is kept for the importer
    return engine, rid


@pytest.mark.parametrize("ending", ["lease", "abort", "ack"])
def test_an_offer_is_freed_by_its_lease_an_abort_or_the_importers_acknowledgement(ending):
    import time

    engine, rid = _offered(tiny_model(HYBRID))
    req = engine.requests[rid]
    assert engine.reclaim_expired_offers(time.monotonic()) == []  # the lease is still running
    if ending == "lease":
        assert engine.reclaim_expired_offers(req.offer_deadline) == [rid]
        assert engine.stats.offers_reclaimed == 1
    elif ending == "abort":
        assert engine.abort(rid) and engine.stats.finished["abort"] == 1
    else:
        assert engine.release_handoff(rid) and engine.stats.transfers_out == 1
        assert not engine.release_handoff(rid)  # a late second acknowledgement changes nothing
    assert req.export_payload is None
    assert_idle_clean(engine)


def test_exporting_a_request_whose_step_in_flight_finishes_it_declines_instead_of_failing():
    """A migration (or a drain) picks a running request; committing the step in flight, which
    the export does first, finishes it. The export declines (None) and the state is freed once,
    after that step (the soak found a KeyError on the freed indices here)."""
    model = tiny_model(HYBRID)
    engine = make_engine(model, overlap=True, deterministic=False)
    spy = InflightSpy(engine)
    rid = engine.add_request(make_prompts(1, seed=8)[0], greedy(max_tokens=4))
    while len(engine.requests[rid].output_ids) < 3:
        engine.step()
    assert rid in engine.in_flight_ids()  # the step producing token 4 of 4 is in flight
    assert engine.export_running(rid) is None
    assert engine.requests.get(rid) is None or engine.requests[rid].state == State.FINISHED
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()
    assert spy.violations == [] and engine.stats.finished["length"] == 1
    assert_idle_clean(engine)


def test_a_prompt_that_fits_once_an_offer_is_freed_waits_for_it_instead_of_ending():
    """A prefill replica holds each request it offered until the importer acknowledges (or the
    lease ends). A prompt that fits the pools, running alone while those offers hold the pages
    it needs next, waits for them: it was given up on as never able to grow (finish_reason
    "length", no token) though the pages come back within the lease."""
    model = tiny_model(HYBRID)
    engine = make_engine(model, role="prefill", kv_capacity_tokens=48, prefix_cache=False)
    a = engine.add_request(make_prompts(1, seed=3, lo=30, hi=30)[0], greedy())
    handoffs = []
    while not handoffs:
        handoffs += [o.handoff for o in engine.step() if o.handoff is not None]
    assert engine.requests[a].state == State.OFFERED
    b = engine.add_request(make_prompts(1, seed=4, lo=24, hi=24)[0], greedy())  # fits once a's pages are back
    for _ in range(10):
        handoffs += [o.handoff for o in engine.step() if o.handoff is not None]
        engine.check_invariants()
    assert b in engine.requests and engine.requests[b].state == State.RUNNING, engine.finished_requests.get(b)
    assert engine.release_handoff(a)  # the importer has it: its pages come back
    while not any(h["request"]["id"] == b for h in handoffs):
        handoffs += [o.handoff for o in engine.step() if o.handoff is not None]
    assert engine.release_handoff(b)
    assert engine.stats.finished == {}
    assert_idle_clean(engine)


def test_a_prompt_that_fits_once_a_waiting_requests_cache_hit_is_let_go_runs_instead_of_ending():
    """A waiting request that matched the prefix cache locks the cached node, which then cannot
    be evicted. A prompt that fits the pools, running alone and short of the pages that node
    holds, was given up on as never able to grow (finish_reason "length", no token); the
    waiting request's hit is let go instead (it matches again when it is admitted)."""
    model = tiny_model(HYBRID)
    engine = make_engine(model, kv_capacity_tokens=48, mamba_track_interval=8, prefill_order="fcfs")
    cached = make_prompts(1, seed=3, lo=20, hi=20)[0]
    engine.add_request(cached, greedy(max_tokens=2))
    run_to_completion(engine)  # its prefix stays cached
    assert engine.pool_usage()["full_kv"]["cached"] == 5
    long = make_prompts(1, seed=4, lo=40, hi=40)[0]  # fits the 12 pages only with the cache evicted
    b = engine.add_request(long, greedy(max_tokens=2))
    for _ in range(3):
        engine.step()
    c = engine.add_request(cached + [1, 2, 3], greedy(max_tokens=2))  # matches the cached prefix
    run_to_completion(engine)
    want = reference_outputs(HYBRID, torch.float32, [long, cached + [1, 2, 3]], max_tokens=2)
    assert [engine.finished_requests[i].output_ids for i in (b, c)] == want
    assert_idle_clean(engine)


@pytest.mark.parametrize("order", ["fcfs", "shortest"])
def test_ranks_lost_while_a_request_is_offered_leave_it_to_its_importer(order):
    """A prefill replica whose ranks are lost (and restarted empty) while a request is offered:
    that request's stream has ended with the hand-off, and the importer takes it from the offer
    (or, with the state gone, rebuilds it from the tokens the offer carries). It was put back in
    the queue to be rebuilt here: a prefill replica never runs a request past its first token,
    so it waited there for good, first in line (with fcfs no request was admitted behind it)."""
    model = tiny_model(HYBRID)
    src = make_engine(model, role="prefill", prefill_order=order)
    dst = make_engine(model, role="decode")
    rid = src.add_request(make_prompts(1, seed=3, lo=10, hi=10)[0], greedy(max_tokens=4))
    handoffs = []
    while not handoffs:
        handoffs += [o.handoff for o in src.step() if o.handoff is not None]
    src.reset_for_recovery()
    assert rid not in src.requests
    assert dst.import_request(handoffs[0]) == Outcome.VERIFIED
    assert not src.release_handoff(rid)  # nothing held there any more
    b = src.add_request([1, 2, 3, 4], greedy(max_tokens=4))
    for _ in range(20):
        handoffs += [o.handoff for o in src.step() if o.handoff is not None]
    assert [h["request"]["id"] for h in handoffs] == [rid, b]
    assert src.release_handoff(b)
    assert_idle_clean(src)
    run_to_completion(dst)
    assert dst.finished_requests[rid].finish_reason == "length"
    dst.finished_requests.clear()
    assert_idle_clean(dst)


def test_ranks_lost_keep_an_operators_hold_on_a_retracted_request():
    """A request an operator retracted and holds stays retracted and held when the ranks are
    lost and restarted: its state is gone, so the operator's resume rebuilds it by prefill, and
    it ends with the uninterrupted run's tokens. (Every live request used to go back to the
    queue, the hold dropped: the held request ran again on its own.)"""
    model = tiny_model(HYBRID)
    eng = make_engine(model)
    prompt = make_prompts(1, seed=5, lo=12, hi=12)[0]
    ref = make_engine(model)
    ref_id = ref.add_request(prompt, greedy(max_tokens=6))
    while ref_id in ref.requests:
        ref.step()
    want = ref.finished_requests[ref_id].output_ids
    rid = eng.add_request(prompt, greedy(max_tokens=6))
    while len(eng.requests[rid].output_ids) < 2:
        eng.step()
    eng.retract([rid], mode="cpu_tensor", hold=True)
    eng.executor.rank.discard(rid)  # the lost rank's memory, backup included, went with it
    eng.reset_for_recovery()
    req = eng.requests[rid]
    assert req.state is State.RETRACTED and req.hold and req.backup is None
    for _ in range(5):
        eng.step()
    assert eng.requests[rid].state is State.RETRACTED  # nothing resumed it
    eng.resume([rid])
    while rid in eng.requests:
        eng.step()
    assert eng.finished_requests[rid].output_ids == want
    assert_idle_clean(eng)


@pytest.mark.parametrize("deterministic", [True, False])
def test_requests_rebuilt_after_the_ranks_were_lost_decode_to_the_end(deterministic):
    """Running requests rebuilt by prefill after the ranks were lost and restarted go on to
    their last token. Recovery gave them a plain dict for indices, without the snapshot the
    decode lane takes of a request's indices: every step after their rebuild raised, so over
    Ray each one counted as another rank failure until the replica gave up and failed them."""
    eng = make_engine(tiny_model(HYBRID), deterministic=deterministic)
    ids = [eng.add_request(p, greedy(max_tokens=12, ignore_eos=True)) for p in make_prompts(2, seed=1, lo=6, hi=10)]
    while min(len(eng.requests[i].output_ids) for i in ids) < 3:
        eng.step()
    eng.reset_for_recovery()
    run_to_completion(eng)
    assert [eng.finished_requests[i].finish_reason for i in ids] == ["length", "length"]
    assert_idle_clean(eng)
