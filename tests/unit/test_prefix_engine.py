"""The prefix cache wired into the engine (issue 16): hits change nothing but the work done.

Every scenario runs twice on the same tiny hybrid model (full attention, sliding window of 5,
Mamba2; pages of 4 tokens, a track interval of 8), with the cache on and off, in deterministic
mode: the outputs must be identical token for token, the cache-on run must actually hit, and
every pool must come back to baseline (run_requests: invariants after every step, the tree's
among them, then idle-clean, then a flush frees every unit)."""
from __future__ import annotations

import random

import pytest

from engine_helpers import HYBRID, VOCAB, assert_idle_clean, greedy, make_engine, run_requests, tiny_model
from hyrax.actors.engine.caching import PrefixCaching
from hyrax.actors.engine.mamba_track import TrackWrite
from hyrax.actors.engine.plan import CheckpointWrite
from hyrax.actors.engine.prefix_nodes import CACHE_OWNER
from hyrax.actors.engine.request import SamplingParams, State

INTERVAL = 8  # two pages; the sliding window (5) spans two pages as well


def _family(prefix_len: int, n: int, seed: int) -> list[list[int]]:
    """n prompts sharing a `prefix_len`-token prefix, with suffixes of 0..n-1 + 3 tokens, and one
    exact repeat of the first."""
    rng = random.Random(seed)
    prefix = [rng.randrange(VOCAB) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(VOCAB) for _ in range(k + 3)] for k in range(n)]
    return prompts + [list(prompts[0])]


def _waves(engine, waves: list[list[list[int]]], params: SamplingParams) -> list[list[int]]:
    """Run each wave to completion before the next arrives (so a later wave can hit what an
    earlier one cached); the last wave through run_requests (invariants, idle-clean, flush)."""
    outs = []
    for wave in waves[:-1]:
        ids = [engine.add_request(p, params) for p in wave]
        while engine.has_unfinished() or engine.has_inflight():
            engine.step()
            engine.check_invariants()
        assert engine.is_idle_clean(), engine.pool_usage()
        outs += [engine.finished_requests[i].output_ids for i in ids]
    return outs + run_requests(engine, waves[-1], params)


SCENARIOS = {
    # prefix shorter than the interval, equal to it, longer than interval and window, and long
    "below_interval": (6, 3),
    "at_interval": (8, 3),
    "above_interval_and_window": (13, 3),
    "three_intervals": (24, 4),
}


def _run(prefix_len: int, n: int, cache: bool, **kw) -> tuple[list[list[int]], dict]:
    prompts = _family(prefix_len, n, seed=prefix_len)
    params = kw.pop("params", greedy(12))
    engine = make_engine(tiny_model(HYBRID), prefix_cache=cache, mamba_track_interval=INTERVAL, **kw)
    outs = _waves(engine, [prompts[:1], prompts[1:]], params)
    return outs, engine.caching.stats.summary()


@pytest.mark.parametrize("name", list(SCENARIOS))
@pytest.mark.parametrize("overlap", [False, True])
def test_cache_on_and_off_give_identical_tokens(name, overlap):
    prefix_len, n = SCENARIOS[name]
    off, _ = _run(prefix_len, n, False, overlap=overlap)
    on, s = _run(prefix_len, n, True, overlap=overlap)
    assert on == off
    assert s["hits"] >= 1 and s["hit_tokens"] >= min(prefix_len, INTERVAL) // 4 * 4, s
    assert s["corrupt_checkpoints"] == 0, s


@pytest.mark.parametrize("backup", ["cpu_tensor", "recompute"])
def test_identical_under_forced_retraction_every_three_steps_with_seeded_sampling(backup):
    params = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=7)
    kw = dict(overlap=True, forced_retraction_interval=3, retraction_backup=backup, params=params)
    off, _ = _run(24, 4, False, **kw)
    on, s = _run(24, 4, True, **kw)
    assert on == off
    assert s["hits"] >= 1, s


def test_a_corrupt_checkpoint_is_detected_and_costs_only_a_prefill():
    prompts = _family(24, 3, seed=3)
    off = _waves(make_engine(tiny_model(HYBRID), prefix_cache=False), [prompts[:1], prompts[1:]], greedy(12))
    engine = make_engine(tiny_model(HYBRID), mamba_track_interval=INTERVAL)
    first = _waves_keep(engine, prompts[:1])
    pool = engine.executor.rank.pools["mamba_ssm.checkpoint"]
    pool += 1.0  # every cached recurrent state is now wrong
    rest = run_requests(engine, prompts[1:], greedy(12))
    s = engine.caching.stats.summary()
    assert first + rest == off
    assert s["corrupt_checkpoints"] >= 1 and s["hits"] == 0, s


def _waves_keep(engine, wave: list[list[int]]) -> list[list[int]]:
    """One wave run to completion, the cache left as it is."""
    ids = [engine.add_request(p, greedy(12)) for p in wave]
    while engine.has_unfinished():
        engine.step()
    return [engine.finished_requests[i].output_ids for i in ids]


def test_the_cache_is_evicted_before_any_request_is_retracted():
    """A pool too small to keep every prefix: later waves must evict cached prefixes (LRU) to
    run, never retract a request for them, and still give the cache-off tokens."""
    waves = [[p] for p in (_family(24, 1, seed=s)[0] for s in range(6))]
    kw = dict(kv_capacity_tokens=96, swa_capacity_tokens=96, mamba_track_interval=INTERVAL)
    off = _waves(make_engine(tiny_model(HYBRID), prefix_cache=False, **kw), waves, greedy(12))
    engine = make_engine(tiny_model(HYBRID), **kw)
    on = _waves(engine, waves, greedy(12))
    s, e = engine.caching.stats.summary(), engine.stats.summary()
    assert on == off
    assert s["evicted_units"].get("full_kv", 0) > 0 and e["retractions"] == 0, (s, e)


def test_abort_of_a_waiting_request_that_matched_unlocks_its_prefix():
    prompts = _family(24, 2, seed=5)
    engine = make_engine(tiny_model(HYBRID), mamba_track_interval=INTERVAL)
    _waves_keep(engine, prompts[:1])
    waiting = engine.add_request(prompts[2], greedy(4))
    req = engine.requests[waiting]
    engine.caching.attach([req])  # what planning does first for the requests it may admit
    assert req.state == State.WAITING and req.cache.node is not None and req.num_computed == 24
    assert engine.caching.tree.root.ref == 1
    engine.check_invariants()
    engine.abort(waiting)
    assert engine.caching.tree.root.ref == 0 and req.cache is None
    assert_idle_clean(engine)


class LiveFieldsCaching(PrefixCaching):
    """Mutant (the third seed's bug): result processing takes the checkpoint position from the
    request's live track (the write planned last) instead of the step's own snapshot."""

    def commit(self, plan, result, table):
        live = []
        for cw in plan.checkpoints:
            req = table.get(cw.req_id)
            hold = req.cache if req is not None else None
            if hold is not None and hold.track is not None and hold.track.pending:
                w: TrackWrite = hold.track.pending[-1]
                live.append(CheckpointWrite(cw.req_id, w.position,
                                            tuple((n, s, w.slots.as_dict()[n]) for n, s, _ in cw.slots), cw.in_prompt))
            else:
                live.append(cw)
        super().commit(_with_checkpoints(plan, live), result, table)


def _with_checkpoints(plan, writes):
    import dataclasses
    return dataclasses.replace(plan, checkpoints=tuple(writes))


def test_mutation_processing_from_live_fields_under_overlap_changes_tokens(monkeypatch):
    """The identity test above, with result processing reading live fields: under overlap a
    step's results are processed after the next step was planned, so the mutant files a
    checkpoint under the wrong prefix and later hits replay the wrong state."""
    import hyrax.actors.engine.engine as engine_module
    prefix_len, n = SCENARIOS["three_intervals"]
    kw = dict(overlap=True, prefill_chunk=INTERVAL)  # every chunk ends on a boundary: writes in a row
    off, _ = _run(prefix_len, n, False, **kw)
    on, s = _run(prefix_len, n, True, **kw)
    assert on == off and s["hits"] >= 1 and s["corrupt_checkpoints"] == 0, s
    monkeypatch.setattr(engine_module, "PrefixCaching", LiveFieldsCaching)
    try:
        on, s = _run(prefix_len, n, True, **kw)
    except AssertionError:
        return  # the tree's invariants caught it
    # the wrong slot is filed under a prefix: its checksum (of the step's own write) exposes it at
    # the hit, or, where it happens to match, the tokens change
    assert on != off or s["corrupt_checkpoints"] > 0, s



@pytest.mark.parametrize("overlap", [False, True])
def test_abort_of_a_running_hit_mid_decode_leaves_the_tree_unreferenced(overlap):
    prompts = _family(24, 2, seed=9)
    engine = make_engine(tiny_model(HYBRID), mamba_track_interval=INTERVAL, overlap=overlap)
    _waves_keep(engine, prompts[:1])
    rid = engine.add_request(prompts[1], greedy(40))
    for _ in range(6):
        engine.step()
    req = engine.requests[rid]
    assert req.state == State.RUNNING and req.cache.node is not None and req.output_ids
    assert engine.stats.prefix.hits == 1
    engine.abort(rid)
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()
    assert engine.caching.tree.root.ref == 0
    assert_idle_clean(engine)


@pytest.mark.parametrize("overlap", [False, True])
def test_several_checkpoints_in_one_chunk_are_cached_and_hit_with_unchanged_tokens(overlap):
    """Not deterministic: a 32-token chunk passes the boundaries at 8, 16 and 24 and the forward
    writes a checkpoint at each (batch.Capture, several points of one slice); the next wave's
    prompts, sharing 24 tokens, hit all 24 and generate what a cold run does."""
    prefix_len, n = SCENARIOS["three_intervals"]
    kw = dict(deterministic=False, prefill_chunk=32, max_batch_tokens=64, overlap=overlap)
    off, _ = _run(prefix_len, n, False, **kw)
    prompts = _family(prefix_len, n, seed=prefix_len)
    engine = make_engine(tiny_model(HYBRID), prefix_cache=True, mamba_track_interval=INTERVAL, **kw)
    first = engine.add_request(prompts[0], greedy(12))
    engine.step()  # the whole 27-token prompt in one chunk
    while engine.has_inflight() and engine.stats.prefix.checkpoints == 0:
        engine.step()
    assert engine.stats.prefix.checkpoints == 3  # 8, 16 and 24 (also its last whole page), all inside the chunk
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()
    on = [engine.finished_requests[first].output_ids] + run_requests(engine, prompts[1:], greedy(12))
    s = engine.caching.stats.summary()
    assert on == off
    assert s["hits"] >= n and s["hit_tokens"] >= n * prefix_len and s["corrupt_checkpoints"] == 0, s


def _steps_until_done(engine, limit: int = 300) -> None:
    for _ in range(limit):
        if not engine.has_unfinished() and not engine.has_inflight():
            return
        engine.step()
        engine.check_invariants()
    raise AssertionError(f"requests still unfinished after {limit} steps: {engine.counts()}, {engine.pool_usage()}")


def _retract_and_finish(mode: str, max_tokens: int) -> None:
    """A 36-token prompt in a 16-page pool, retracted at 40 tokens (its pages up to there
    cached) and restored: it must finish with the cache-off tokens."""
    prompt = _family(36, 1, seed=11)[0][:36]
    kw = dict(kv_capacity_tokens=64, mamba_track_interval=INTERVAL)
    off = run_requests(make_engine(tiny_model(HYBRID), prefix_cache=False, **kw), [prompt], greedy(max_tokens))
    engine = make_engine(tiny_model(HYBRID), **kw)
    rid = engine.add_request(prompt, greedy(max_tokens))
    while engine.requests[rid].num_computed < 40:
        engine.step()
    assert engine.caching.cached()["full_kv"] == 10  # every page up to its checkpoint at 40
    assert engine.retract([rid], mode=mode)[rid].value == mode
    _steps_until_done(engine)
    assert engine.finished_requests[rid].output_ids == off[0]
    assert engine.stats.restores.get("verified", 0) == 1, engine.stats.restores
    assert_idle_clean(engine)


@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool"])
def test_a_restore_evicts_the_cache_it_needs_room_from(mode):
    """A request's own prefix, adopted by the cache, stays cached when the request is retracted;
    the restore needs new pages for every live row. With the pool too small for both, the
    restore must evict the (unreferenced) cache, not wait for room forever (it waited: a
    retracted request stops admissions, so nothing else ever evicted)."""
    _retract_and_finish(mode, 7)  # done at 43 tokens: no checkpoint after the restore


def test_a_restored_request_never_pins_its_old_cached_pages():
    """Restored into pages of its own, the request reaches its next checkpoint (48) on a path
    the cache holds in its old pages: hanging the checkpoint there while it reads its own copy
    would lock the old one too, and its 56 tokens no longer fit the pool ("length" at 15
    tokens). (It reads the old pages again and frees its copies: Inserted.reuse.)"""
    _retract_and_finish("cpu_tensor", 20)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_never_pins_cached_pages_it_does_not_use(overlap):
    """Two requests with one prompt arrive together: both prefill it, the first one's pages are
    cached. The second must not lock the cached path while it reads its own copies of it:
    pinned, those pages stay out of reach of eviction while it runs, and in a pool that holds its
    tokens only once it ran out of room and finished early ("length"). (It reads the cached
    pages instead and frees its copies: Inserted.reuse.)"""
    prompt = _family(24, 1, seed=13)[0][:26]
    kw = dict(kv_capacity_tokens=64, mamba_track_interval=INTERVAL, overlap=overlap)
    params = [greedy(1), greedy(30)]  # 26 + 30 tokens: 14 of the pool's 16 pages
    off = run_requests(make_engine(tiny_model(HYBRID), prefix_cache=False, **kw), [prompt, prompt], params)
    engine = make_engine(tiny_model(HYBRID), **kw)
    on = run_requests(engine, [prompt, prompt], params)
    assert engine.stats.finished["length"] == 2 and on == off
    assert engine.caching.stats.checkpoints >= 1



def test_a_retracted_request_is_restored_though_a_waiting_request_matched_its_prefix():
    """A waiting request that matched a running request's cached prefix locks those pages; the
    running one is retracted, and its restore needs new pages for all of its tokens. A retracted
    request holds admissions back, so the waiting one would never run to let go of them: the
    restore waited forever (the waiting request lets go of its hit while admissions are closed)."""
    prompt = _family(36, 1, seed=23)[0][:36]
    other = prompt[:24] + [5, 6, 7, 8, 9]  # hits 24 tokens of it: 6 pages
    kw = dict(kv_capacity_tokens=64, mamba_slots=1, mamba_track_interval=INTERVAL)  # one slot: the other waits
    outs = []
    for cache in (False, True):
        engine = make_engine(tiny_model(HYBRID), prefix_cache=cache, **kw)
        rid = engine.add_request(prompt, greedy(12))
        while engine.requests[rid].num_computed < 44:  # 11 of the pool's 16 pages
            engine.step()
        wid = engine.add_request(other, greedy(3))
        engine.step()
        assert engine.requests[wid].state == State.WAITING
        assert engine.retract([rid], mode="cpu_tensor")[rid].value == "cpu_tensor"
        _steps_until_done(engine)
        outs.append([engine.finished_requests[i].output_ids for i in (rid, wid)])
        assert_idle_clean(engine)
    assert outs[1] == outs[0]


def _shared_units_are_the_caches(engine) -> None:
    """Every cached unit in a running request's tables is still the cache's and lies on the path
    of the node the request locked (so nothing can evict it while the request reads it)."""
    tree = engine.caching.tree
    for req in engine.running:
        hold = req.cache
        if hold is None:
            continue
        on_path = {}
        n = hold.node
        while n is not None and n is not tree.root:
            for pool, units in tree._units(n):
                on_path.setdefault(pool, set()).update(units)
            n = n.parent
        for pool, units in hold.shared.items():
            for u in units:
                if u in req.indices[pool]:
                    assert engine.alloc[pool].owned_by(CACHE_OWNER).count(u) == 1 and u in on_path.get(pool, ()), \
                        (req.id, pool, u, hold.node)


def test_a_request_keeps_the_lock_on_the_pages_the_cache_took_from_it():
    """r1 hits 16 tokens, prefills 16..24 itself, and caches 20..24 below the edge 16..20 that r0
    computed (no checkpoint there: r1 diverges from r0 at 20). r2 then caches a checkpoint at 20
    on that edge. At its next checkpoint (32) r1 must keep its lock where it was: moved up to
    the hit, the page the cache took from r1 (positions 20..23), still in r1's page table, could
    be evicted and handed to another request while r1 reads it."""
    rng = random.Random(29)
    p = [rng.randrange(VOCAB) for _ in range(20)]
    r0, r1, r2 = p + [1, 2, 3, 4], p + [5, 6, 7, 8], p + [9, 10]
    r3 = [rng.randrange(VOCAB) for _ in range(16)]
    kw = dict(mamba_track_interval=INTERVAL)
    outs = []
    for cache in (False, True):
        engine = make_engine(tiny_model(HYBRID), prefix_cache=cache, **kw)
        a = engine.add_request(r0, greedy(1))
        _steps_until_done(engine)
        b = engine.add_request(r1, greedy(20))
        while engine.requests[b].num_computed < 24:
            engine.step()
        c = engine.add_request(r2, greedy(1))
        while engine.requests[b].num_computed < 33:
            engine.step()
            if cache:
                _shared_units_are_the_caches(engine)
        engine.flush_cache()  # whatever no request holds
        d = engine.add_request(r3, greedy(4))  # takes the freed pages
        while engine.has_unfinished() or engine.has_inflight():
            engine.step()
            engine.check_invariants()
        outs.append([engine.finished_requests[i].output_ids for i in (a, b, c, d)])
        assert_idle_clean(engine)
    assert outs[1] == outs[0]


def test_a_waiting_request_s_hit_does_not_get_a_running_request_retracted():
    """Two running requests fill the pool while a waiting one (no slot left for it) matched a
    cached prefix: when a running request needs a page, the waiting request's hit goes and the
    prefix is evicted - no request is retracted for pages a request that is not running holds
    (the cache-off run retracts none)."""
    rng = random.Random(31)
    cached = [rng.randrange(VOCAB) for _ in range(24)]
    runs = [[rng.randrange(VOCAB) for _ in range(12)] for _ in range(2)]  # 12 + 20 tokens: 8 pages each
    kw = dict(kv_capacity_tokens=64, mamba_slots=2, mamba_track_interval=INTERVAL, prefill_order="fcfs")
    outs = []
    for cache in (False, True):
        engine = make_engine(tiny_model(HYBRID), prefix_cache=cache, **kw)
        first = engine.add_request(cached, greedy(1))
        _steps_until_done(engine)
        rs = [engine.add_request(p, greedy(20, ignore_eos=True)) for p in runs]
        w = engine.add_request(cached + [1, 2, 3, 4], greedy(4))  # matches 24 tokens: 6 pages
        engine.step()
        assert engine.requests[w].state == State.WAITING
        _steps_until_done(engine)
        outs.append([engine.finished_requests[i].output_ids for i in (first, *rs, w)])
        assert engine.stats.summary()["retractions"] == 0, (cache, engine.stats.summary()["retractions"])
        assert_idle_clean(engine)
    assert outs[1] == outs[0]


def test_a_request_that_hit_nothing_never_pins_an_edge_others_computed():
    """x and y share 12 tokens and diverge: the cache holds the edge 0..12 (x's pages) with no
    checkpoint at its end. r shares those 12 tokens too, hits nothing (no checkpoint on its
    path) and prefills them in pages of its own; caching its checkpoint at 16 below that edge
    while it reads its own copies would lock x's 3 pages too, for as long as it runs - here the
    difference between its 56 tokens fitting the pool or ending with "length" early. (It reads
    x's pages instead and frees its copies: Inserted.reuse.)"""
    rng = random.Random(37)
    p = [rng.randrange(VOCAB) for _ in range(12)]
    x, y, r = (p + [rng.randrange(VOCAB) for _ in range(4)] for _ in range(3))
    kw = dict(kv_capacity_tokens=64, mamba_track_interval=16)
    outs = []
    for cache in (False, True):
        engine = make_engine(tiny_model(HYBRID), prefix_cache=cache, **kw)
        ids = [engine.add_request(q, greedy(1)) for q in (x, y)]
        _steps_until_done(engine)
        ids.append(engine.add_request(r, greedy(40)))  # 16 + 40 tokens: 14 of the pool's 16 pages
        _steps_until_done(engine)
        outs.append([engine.finished_requests[i].output_ids for i in ids])
        assert_idle_clean(engine)
    assert outs[1] == outs[0]


def test_a_prompt_ending_inside_an_edge_others_computed_never_pins_it():
    """a's 8 tokens are cached as one edge with its checkpoint at 8. b is a's first page and one
    more token: it hits nothing (no checkpoint at 4), prefills page 0 in a page of its own, and
    its checkpoint at 4 falls inside a's edge. Caching it there splits the edge; locking a's page
    0 while b reads its own copy would pin it for as long as b runs: b's 64 tokens fill the pool,
    and with that page pinned it ended with "length" at 56 of them. (b reads a's page instead
    and frees its copy, so a repeat of b hits: the test below.)"""
    rng = random.Random(41)
    p = [rng.randrange(VOCAB) for _ in range(7)]
    a, b = p + [0], p[:4] + [1]
    kw = dict(kv_capacity_tokens=64, mamba_track_interval=INTERVAL)
    outs = []
    for cache in (False, True):
        engine = make_engine(tiny_model(HYBRID), prefix_cache=cache, **kw)
        ids = [engine.add_request(a, greedy(1))]
        _steps_until_done(engine)
        ids.append(engine.add_request(b, greedy(59, ignore_eos=True)))  # 5 + 59 tokens: the pool's 16 pages
        _steps_until_done(engine)
        outs.append([engine.finished_requests[i].output_ids for i in ids])
        assert_idle_clean(engine)
    assert [len(o) for o in outs[1]] == [1, 59] and outs[1] == outs[0]


def _waves_on_off(cache: bool, waves, **kw):
    """Run each wave (prompt, params) to completion in turn; (outputs, engine)."""
    engine = make_engine(tiny_model(HYBRID), prefix_cache=cache, **kw)
    outs = []
    for wave in waves:
        ids = [engine.add_request(p, params) for p, params in wave]
        _steps_until_done(engine)
        outs += [engine.finished_requests[i].output_ids for i in ids]
    assert_idle_clean(engine)
    return outs, engine


def test_a_prompt_ending_inside_an_edge_another_request_computed_is_cached():
    """a's 8 tokens are one cached edge with its checkpoint at 8. b is a's first page and one
    more token: it hits nothing (no checkpoint at 4) and prefills page 0 itself, and its
    checkpoint at 4 falls inside a's edge. That checkpoint was rejected (hanging it there would
    have pinned a's page 0, which b never read), so c, a repeat of b, hit nothing while a's edge
    stayed cached. Now b reads a's page 0 instead of its own copy and c hits b's 4 tokens."""
    rng = random.Random(41)
    p = [rng.randrange(VOCAB) for _ in range(7)]
    a, b = p + [0], p[:4] + [1]
    waves = [[(a, greedy(1))], [(b, greedy(6))], [(list(b), greedy(6))]]
    kw = dict(kv_capacity_tokens=64, mamba_track_interval=INTERVAL)
    off, _ = _waves_on_off(False, waves, **kw)
    on, engine = _waves_on_off(True, waves, **kw)
    s = engine.caching.stats.summary()
    assert on == off
    assert s["hits"] == 1 and s["hit_tokens"] == 4, s


def test_a_request_that_hit_never_pins_the_edge_it_diverges_from():
    """r0 (24 tokens) is cached with checkpoints at 8, 16 and 24. r1 shares 20 tokens with it:
    it hits 16, prefills 16..24 itself and diverges at 20, so its checkpoint at 24 hangs below
    a split of r0's edge 16..24 at 20. It locked r0's page 16..19 there, which it never read
    (it had its own): its 24 + 40 tokens take the pool's 16 pages, and with that page pinned it
    ended with "length" early. Now it reads r0's page and gives back its own copy."""
    rng = random.Random(43)
    p = [rng.randrange(VOCAB) for _ in range(20)]
    r0, r1 = p + [1, 2, 3, 4], p + [5, 6, 7, 8]
    waves = [[(r0, greedy(1))], [(r1, greedy(40, ignore_eos=True))]]
    kw = dict(kv_capacity_tokens=64, mamba_track_interval=INTERVAL)
    off, _ = _waves_on_off(False, waves, **kw)
    on, engine = _waves_on_off(True, waves, **kw)
    assert [len(o) for o in on] == [1, 40] and on == off
    assert engine.caching.stats.summary()["hit_tokens"] == 16
