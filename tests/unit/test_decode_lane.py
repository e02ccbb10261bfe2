"""The decode lane (engine/lane.py) plans exactly what planning without it plans.

Every step an engine plans with lane rows, the same scheduler is also asked with a full view
of the same moment (every running request as a view, no lane; scheduling is a pure function),
and the two answers must be the same: the same entries in the same order, the same admissions
and grants. Scenarios cover what changes a lane row's next entry or takes it out: pages opened
every PAGE_SIZE tokens, window pages released, stop tokens and max_tokens, a token budget
smaller than the decodes, forced and memory-pressure retractions, aborts, penalties (never in
the lane), seeded sampling, overlap on and off, the prefix cache. Each scenario must put rows
in the lane, and its tokens must equal a run with the lane switched off.
"""
from __future__ import annotations

import random

import pytest

from engine_helpers import HYBRID, assert_idle_clean, greedy, make_engine, make_prompts, run_requests, tiny_model
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.scheduler import NeedRoom, Scheduled
from hyrax.actors.engine.view import build_view


class LaneCheck:
    """Wraps an engine's scheduler: whenever a view carries lane rows, plans the same moment
    from a full view as well and records any difference."""

    def __init__(self, engine):
        self.engine, self.lane_rows, self.checked, self.diffs = engine, 0, 0, []
        inner = engine.scheduler.schedule

        def schedule(view):
            got = inner(view)
            if view.lane is not None:
                self.lane_rows += len(view.lane.block)
                self._compare(view, got, inner)
            return got
        engine.scheduler.schedule = schedule

    def _compare(self, view, got, inner) -> None:
        e = self.engine
        listed = max((len(p.next) for p in view.free.values()), default=0)  # as long free lists as the view's
        full = inner(build_view(view.step, e.running, e.waiting, e.alloc, e.inflight.plan,
                                e.scheduler.config.max_running, listed, view.admit_new, view.reserve_ratio))
        self.checked += 1
        if isinstance(got, NeedRoom):
            if not got.widen and got != full:
                self.diffs.append((view.step, "need room", got, full))
            return  # widen: the engine asks again with the full view
        if not isinstance(full, Scheduled):
            self.diffs.append((view.step, "the full view needs room", full))
            return
        for name in ("admitted", "grants", "pressure", "short"):
            if getattr(got, name) != getattr(full, name):
                self.diffs.append((view.step, name, getattr(got, name), getattr(full, name)))
        # the same rows (the decode block's run first; the others keep the full view's order)
        by_id = sorted(got.plan.all_entries(), key=lambda x: x.req_id)
        if by_id != sorted(full.plan.entries, key=lambda x: x.req_id):
            self.diffs.append((view.step, "entries", by_id, sorted(full.plan.entries, key=lambda x: x.req_id)))
        rest = set(got.plan.req_ids[got.plan.num_decode:])
        if list(got.plan.entries) != [x for x in full.plan.entries if x.req_id in rest]:
            self.diffs.append((view.step, "order", got.plan.entries, full.plan.entries))
        carried = set(got.lane.block.req_ids if got.lane is not None else ()) | {j.entry.req_id for j in got.joiners}
        if carried != {j.entry.req_id for j in full.joiners}:
            self.diffs.append((view.step, "next lane", carried, full.joiners))
        # no block row ends on a checkpoint boundary (the prefix cache writes those through entries)
        if e.config.caches_prefixes and got.plan.decode is not None:
            policy = e.caching.policy
            for rid, start in zip(got.plan.decode.req_ids, got.plan.decode.starts.tolist()):
                if policy.is_boundary(start + 1, len(e.requests[rid].prompt_ids)):
                    self.diffs.append((view.step, "boundary in the block", rid, start))


def _run(engine, prompts, params, abort_at: dict[int, int] | None = None, lane: bool = True):
    engine.lane.enabled = lane
    check = LaneCheck(engine)
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    abort_at = abort_at or {}
    for step in range(10_000):
        if not engine.has_unfinished() and not engine.has_inflight():
            break
        if step in abort_at:
            engine.abort(ids[abort_at[step]])
        engine.step()
        engine.check_invariants()
    else:
        raise AssertionError("unfinished after 10000 steps")
    assert_idle_clean(engine)
    outs = [engine.finished_requests[i].output_ids if i in engine.finished_requests else None for i in ids]
    return outs, check


def _params(n: int, seed: int, kinds: str) -> list[SamplingParams]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        max_tokens = rng.randint(3, 40)
        if "sampled" in kinds and i % 3 == 1:
            out.append(SamplingParams(max_tokens=max_tokens, temperature=0.8, top_p=0.9, seed=100 + i))
        elif "penalties" in kinds and i % 4 == 2:
            out.append(greedy(max_tokens, presence_penalty=0.5, frequency_penalty=0.3))
        elif "stops" in kinds and i % 5 == 3:
            out.append(greedy(max_tokens, stop_token_ids=(rng.randrange(96),)))
        else:
            out.append(greedy(max_tokens))
    return out


SCENARIOS = {
    "plain": dict(config={}, kinds=""),
    "overlap": dict(config=dict(overlap=True, deterministic=False), kinds="sampled stops"),
    "budget below the decodes": dict(config=dict(max_batch_tokens=16, prefill_chunk=8), kinds="stops"),
    "forced retraction": dict(config=dict(forced_retraction_interval=3, overlap=True), kinds="sampled"),
    "memory pressure": dict(config=dict(kv_capacity_tokens=160), kinds="penalties"),
    "no prefix cache": dict(config=dict(prefix_cache=False, overlap=True), kinds="penalties stops"),
    "aborts": dict(config=dict(overlap=True), kinds="sampled", aborts={5: 0, 9: 3, 14: 7}),
    # pages of 8 and a window of 4 rows: window pages go back between page crossings, and the
    # lane carries its rows on with their new tables (both pipelines)
    "window release inside pages": dict(config=dict(page_size=8, overlap=True, deterministic=False), kinds=""),
    "window release inside pages, synchronous": dict(config=dict(page_size=8), kinds="stops"),
    # no paged component: a row that reaches a page start takes nothing (no grant, as a view's entry)
    "no paged component": dict(layout="mamba", config=dict(overlap=True, deterministic=False), kinds="sampled"),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_lane_plans_what_the_full_view_plans(name):
    sc = SCENARIOS[name]
    model = tiny_model(sc.get("layout", HYBRID))
    prompts = make_prompts(24, seed=3, lo=2, hi=30)
    params = _params(len(prompts), 7, sc["kinds"])
    outs, check = _run(make_engine(model, **sc["config"]), prompts, params, sc.get("aborts"))
    assert check.diffs == [], check.diffs[:3]
    assert check.lane_rows > 100 and check.checked > 10, (check.lane_rows, check.checked)
    ref, off = _run(make_engine(model, **sc["config"]), prompts, params, sc.get("aborts"), lane=False)
    assert off.lane_rows == 0
    if "aborts" not in sc:  # an abort lands on a different token count when timing differs: compare the rest
        assert outs == ref
    else:
        kept = [k for k in range(len(prompts)) if k not in sc["aborts"].values()]
        assert [outs[k] for k in kept] == [ref[k] for k in kept]


def test_lane_rows_that_changed_take_the_general_path():
    """A lane row whose request was retracted and restored between two plans (new indices) is
    not advanced from its old entry: the check above would see the old page tables."""
    model = tiny_model(HYBRID)
    engine = make_engine(model, overlap=False)
    check = LaneCheck(engine)
    ids = [engine.add_request(p, greedy(30)) for p in make_prompts(6, seed=1, lo=3, hi=9)]
    for _ in range(6):
        engine.step()
    before = check.lane_rows
    assert before > 0
    engine.retract([ids[0], ids[2]], mode="cpu_tensor")
    engine.resume([ids[0], ids[2]])
    for _ in range(200):
        if not engine.has_unfinished() and not engine.has_inflight():
            break
        engine.step()
    assert check.diffs == [], check.diffs[:3]
    assert_idle_clean(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_stop_ids_met_inside_the_lane_stop_the_request(overlap):
    """Each request's stop id is the token it produces 7th (from a run without stops): it is
    met while the request decodes in the lane, whose result processing checks stops for the
    whole block at once, and must end it there as the general path does."""
    model = tiny_model(HYBRID)
    prompts = make_prompts(12, seed=4, lo=2, hi=20)
    free, _ = _run(make_engine(model, overlap=overlap), prompts, [greedy(30)] * len(prompts), lane=False)
    params = [greedy(30, stop_token_ids=(out[6],)) for out in free]
    outs, check = _run(make_engine(model, overlap=overlap), prompts, params)
    ref, _ = _run(make_engine(model, overlap=overlap), prompts, params, lane=False)
    assert check.diffs == [] and check.lane_rows > 20
    assert outs == ref
    assert all(len(o) <= 7 for o in outs), [len(o) for o in outs]


def test_a_max_tokens_beyond_any_context_runs_as_a_large_one():
    """max_tokens has no upper bound in the engine (the API caps it by the context; `hyrax
    generate` and the Python API do not): one past int64 kept the decode lane's block from
    being built, which failed the step. The same tokens as the same requests with max_tokens 12,
    for their first 12."""
    prompts = make_prompts(2, seed=6)
    short = run_requests(make_engine(tiny_model(HYBRID)), prompts,
                         [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in (1, 2)])
    engine = make_engine(tiny_model(HYBRID))
    ids = [engine.add_request(p, SamplingParams(max_tokens=m, temperature=1.0, seed=s))
           for p, m, s in zip(prompts, (10**20, 2**63), (1, 2))]
    while any(len(engine.requests[i].output_ids) < 12 for i in ids):
        engine.step()
        engine.check_invariants()
    assert [engine.requests[i].output_ids[:12] for i in ids] == short
    for i in ids:
        engine.abort(i)
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()


@pytest.mark.parametrize("overlap", [False, True])
def test_a_lane_row_opens_its_next_page_without_a_view(overlap):
    """A steady decode whose next token opens a page stays in the lane: the scheduler takes the
    page for its row (in arrival order with the other decodes) instead of planning the request
    through a view for a step. Once every request decodes steadily, no step plans a running
    request through a view, while the requests cross several pages each (pages of 8 tokens,
    40 outputs); the tokens are a run's without the lane (the plans are compared with the full
    view's in the scenarios above)."""
    model = tiny_model(HYBRID)
    config = dict(page_size=8, prefix_cache=False, overlap=overlap)
    prompts = make_prompts(6, seed=5, lo=3, hi=20)
    params = [greedy(40)] * len(prompts)
    engine = make_engine(model, **config)
    # running requests with a token left to draw planned through a view, per step with every
    # request steady (one whose last token the step in flight draws has a view, and no step)
    views: list[int] = []
    inner = engine.scheduler.schedule

    def schedule(view):
        if len(engine.running) == len(prompts) and all(len(r.output_ids) >= 3 for r in engine.running):
            views.append(sum(len(r.ids) - r.num_prompt < r.params.max_tokens for r in view.running))
        return inner(view)
    engine.scheduler.schedule = schedule
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()
        engine.check_invariants()
    assert_idle_clean(engine)
    assert len(views) >= 16 and sum(views) == 0, views
    ref, _ = _run(make_engine(model, **config), prompts, params, lane=False)
    assert [engine.finished_requests[i].output_ids for i in ids] == ref


@pytest.mark.parametrize("overlap", [False, True])
def test_requests_whose_indices_are_a_plain_mapping_decode_on_off_the_lane(overlap):
    """Indices that are not an IndexTable (a plain dict: made by hand, or rebuilt by a path
    that forgot the type) have no snapshot to carry a lane row with; a request that opens a page
    with them must not fail the step (AttributeError on `snapshot`): its row leaves the lane
    and the general path plans it. The tokens are a run's without the lane."""
    model = tiny_model(HYBRID)
    config = dict(page_size=8, prefix_cache=False, overlap=overlap)
    prompts = make_prompts(4, seed=5, lo=3, hi=12)
    engine = make_engine(model, **config)
    ids = [engine.add_request(p, greedy(30)) for p in prompts]
    for _ in range(4):
        engine.step()
    for r in engine.running:
        r.indices = dict(r.indices)
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()
        engine.check_invariants()
    assert_idle_clean(engine)
    ref, _ = _run(make_engine(model, **config), prompts, [greedy(30)] * len(prompts), lane=False)
    assert [engine.finished_requests[i].output_ids for i in ids] == ref
