"""Mamba track-boundary bookkeeping under overlap scheduling (the third seed's race, as a test).

A request prefills in boundary-aligned chunks and decodes one token per step; the next step is
planned while the previous one runs, and results are processed one step late. Every committed
checkpoint is donated to the prefix cache right away; the test checks that each donated slot
holds the state of exactly the prefix it is cached under, that no boundary is missed, and that
a later request's hit replays the right state. Two mutants show the test can fail: result
processing that reads the track's live fields, and producer and consumer merged into one pointer.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyrax.actors.engine.mamba_track import CheckpointSlots, Committed, Kept, MambaTrack, TrackPolicy, TrackState
from hyrax.actors.engine.prefix_cache import CACHE_OWNER, Checkpoint, checkpoint_pool, transfer
from prefix_cache_world import World


class LiveFieldsTrack(MambaTrack):
    """Mutant (the seed's bug): result processing ignores the step's snapshot and derives the
    boundary and slot from the track's live fields, which the next plan already advanced."""

    def process(self, st: TrackState, w) -> TrackState:
        if st.planned % self.policy.interval:
            return st
        idx = (st.producer - 1) % len(st.ring)
        return replace(st, pending=tuple(p for p in st.pending if p.ring_index != idx),
                       consumer=Committed(idx, st.planned))


class MergedTrack(MambaTrack):
    """Mutant: one pointer means both "the slot the next forward writes" and "the slot holding
    the last committed checkpoint"."""

    def plan(self, st, req_id, start, end, prompt_len):
        st2, w = super().plan(replace(st, pending=(), consumer=None), req_id, start, end, prompt_len)
        return replace(st2, pending=st.pending + ((w,) if w else ()), consumer=st.consumer), w

    def keep(self, st):
        if st.consumer is None:
            return None
        return Kept(st.consumer.position, st.ring[(st.producer - 1) % len(st.ring)])


def step_ends(policy: TrackPolicy, prompt_len: int, total: int, chunk: int) -> list[int]:
    """Prefill chunks of at most `chunk` tokens ending on every boundary, then one token a step."""
    ends, pos = [], 0
    while pos < prompt_len - 1:
        pos = min(pos + chunk, policy.next_boundary(pos, prompt_len), prompt_len)
        ends.append(pos)
    return ends + list(range(max(pos, 0) + 1, total + 1))


def drive(track: MambaTrack, w: World, ids: tuple[int, ...], prompt_len: int, chunk: int, overlap: bool,
          lands_first: bool) -> set[int]:
    """Runs request "r" over `ids` and returns the positions cached for it. Asserts, at every
    donation, that the donated slots hold the state of the prefix they are cached under."""
    ps, n_pages = w.ps, -(-len(ids) // w.ps)
    full = w.alloc["full_kv"].allocate("r", n_pages)
    swa = w.alloc["swa_kv"].allocate("r", n_pages)
    own = {"full_kv": list(full), "swa_kv": list(swa)}

    def slots():
        got = {n: w.alloc[checkpoint_pool(n)].allocate("r", 1)[0] for n in w.slot_names}
        return CheckpointSlots.of(got)

    s = track.start((slots(), slots()))
    cached, locked = set(), []

    def land(end, write):  # the ranks finish a step: rows up to `end`, and its checkpoint
        for k in range((end - 1) // ps + 1):
            rows = tuple((p, ids[p]) for p in range(k * ps, min((k + 1) * ps, end)))
            w.content[("full_kv", full[k])] = w.content[("swa_kv", swa[k])] = rows
        if write is not None:
            for name, slot in write.slots.units:
                w.content[(checkpoint_pool(name), slot)] = ids[:write.position]

    def process(write):
        nonlocal s
        s = track.process(s, write)
        if track.keep(s) is None:
            return
        s, kept = track.donate(s, slots())
        for name, slot in kept.slots.units:
            assert w.content.get((checkpoint_pool(name), slot)) == ids[:kept.position], \
                f"the checkpoint cached at {kept.position} holds another prefix's state"
        ins = w.cache.insert(ids, {"full_kv": full}, {"swa_kv": swa},
                             {kept.position: Checkpoint(kept.slots.as_dict())})
        assert not ins.rejected
        transfer(w.alloc, ins.adopted, "r", CACHE_OWNER)
        for pool, units in ins.adopted.items():
            own[pool] = [u for u in own.get(pool, []) if u not in set(units)]
        w.cache.lock(ins.node)
        locked.append(ins.node)
        cached.add(kept.position)

    in_flight = None
    pos = 0
    for end in step_ends(track.policy, prompt_len, len(ids), chunk):
        s, write = track.plan(s, "r", pos, end, prompt_len)
        pos = end
        if not overlap:
            land(end, write)
            process(write)
            continue
        if in_flight is not None:  # step N+1 is planned; N finishes, N+1 starts, N's results are processed
            land(*in_flight)
            if lands_first:
                land(end, write)  # N+1 already wrote by the time N's results are read
            process(in_flight[1])
        in_flight = (end, write)
    if in_flight is not None:
        land(*in_flight)
        process(in_flight[1])
    for slots_left in track.release(s):
        for name, slot in slots_left.units:
            w.free(checkpoint_pool(name), [slot], "r")
    for pool, units in own.items():
        w.free(pool, units, "r")
    for node in locked:
        w.cache.unlock(node)
    return cached


IDS = tuple(range(500, 541))  # 41 tokens: a 21-token prompt, then 20 decoded
PROMPT_LEN = 21


def expected_positions(policy: TrackPolicy) -> set[int]:
    return {p for p in range(1, len(IDS) + 1) if policy.is_boundary(p, PROMPT_LEN)}


@pytest.mark.parametrize("overlap,lands_first", [(False, False), (True, False), (True, True)])
@pytest.mark.parametrize("chunk", [4, 8, 64])
def test_results_processed_one_step_late_keep_the_right_checkpoint(overlap, lands_first, chunk):
    w = World(page_size=4, interval=8, window=10)
    track = MambaTrack(w.policy)
    assert drive(track, w, IDS, PROMPT_LEN, chunk, overlap, lands_first) == expected_positions(w.policy)
    w.check()
    # a later request sharing 30 tokens hits the checkpoint at 24 and finds its state intact
    m = w.cache.match(IDS[:30])
    assert m.length == 24
    w.verify_hit(IDS[:30], m)
    w.evict()
    assert w.at_baseline()


@pytest.mark.parametrize("mutant", [LiveFieldsTrack, MergedTrack])
@pytest.mark.parametrize("lands_first", [False, True])
def test_mutation_the_race_test_fails_on_live_fields_or_merged_pointers(mutant, lands_first):
    w = World(page_size=4, interval=8, window=10)
    with pytest.raises(AssertionError, match="holds another prefix's state"):
        drive(mutant(w.policy), w, IDS, PROMPT_LEN, 8, True, lands_first)


def test_without_overlap_the_mutants_cache_only_right_states():
    """Sanity for the mutation check: without overlap nothing is ahead of the step being
    processed, so every checkpoint either mutant caches holds the right state (the live-fields
    one still misses the prompt-end boundary) — what breaks them is processing one step late."""
    for cls in (LiveFieldsTrack, MergedTrack):
        w = World(page_size=4, interval=8, window=10)
        policy = TrackPolicy(8, 4)
        cached = drive(cls(policy), w, IDS, PROMPT_LEN, 8, False, False)
        assert cached == {p for p in expected_positions(policy) if p % 8 == 0} | (
            {20} if cls is MergedTrack else set())


def test_a_slot_that_is_committed_or_pending_is_never_planned_again():
    track = MambaTrack(TrackPolicy(4, 4))
    ring = (CheckpointSlots.of({"m": 0}), CheckpointSlots.of({"m": 1}))
    s = track.start(ring)
    s, a = track.plan(s, "r", 0, 4, 100)
    s, b = track.plan(s, "r", 4, 8, 100)
    assert {a.ring_index, b.ring_index} == {0, 1}
    s, c = track.plan(s, "r", 8, 12, 100)
    assert c is None and s.skipped == 1  # both slots busy: the boundary is skipped, nothing overwritten
    s = track.process(s, a)
    s, d = track.plan(s, "r", 12, 16, 100)
    assert d is None  # a's slot is the consumer now: still not writable
    s, kept = track.donate(s, CheckpointSlots.of({"m": 2}))
    assert kept == Kept(4, ring[0])
    s, e = track.plan(s, "r", 16, 20, 100)
    assert e.slots == CheckpointSlots.of({"m": 2})
    with pytest.raises(ValueError):
        track.commit(s, a)  # committed twice
    with pytest.raises(ValueError):
        track.plan(s, "r", 5, 6, 100)  # not where the track is


def test_policy_boundaries_and_validation():
    p = TrackPolicy(8, 4)
    assert [x for x in range(1, 30) if p.is_boundary(x, 22)] == [8, 16, 20, 24]
    assert p.next_boundary(16, 22) == 20 and p.next_boundary(20, 22) == 24 and p.next_boundary(0, 5) == 4
    with pytest.raises(ValueError):
        TrackPolicy(6, 4)


@settings(max_examples=40, deadline=None)
@given(chunk=st.integers(1, 12), prompt=st.integers(2, 30), overlap=st.booleans(), lands_first=st.booleans(),
       interval=st.sampled_from([4, 8, 12]))
def test_any_chunking_and_interleaving_caches_every_boundary_with_its_own_state(chunk, prompt, overlap,
                                                                               lands_first, interval):
    w = World(page_size=4, interval=interval, window=7)
    ids = tuple(range(700, 700 + prompt + 9))
    cached = drive(MambaTrack(w.policy), w, ids, prompt, chunk, overlap, lands_first)
    assert cached == {p for p in range(1, len(ids) + 1) if w.policy.is_boundary(p, prompt)}
    w.check()
    w.evict()
    assert w.at_baseline()


def test_a_request_leaving_while_its_step_runs_abandons_the_write_and_keeps_its_last_checkpoint():
    track = MambaTrack(TrackPolicy(4, 4))
    ring = (CheckpointSlots.of({"m": 0}), CheckpointSlots.of({"m": 1}))
    s = track.start(ring)
    s, a = track.plan(s, "r", 0, 4, 100)
    s = track.process(s, a)
    s, b = track.plan(s, "r", 4, 8, 100)  # retracted or aborted while this step runs
    s = track.abandon(s, b)
    assert track.keep(s) == Kept(4, ring[a.ring_index]) and s.pending == ()
    assert set(track.release(s)) == set(ring)  # every slot it holds goes back at the one free point


def test_only_the_prompts_last_whole_page_cuts_a_chunk():
    p = TrackPolicy(interval=64, page_size=16)
    assert p.chunk_end(0, 256, 1000) == 256  # crosses 64, 128, 192: not cut (a checkpoint at 256)
    assert p.chunk_end(768, 1000, 1000) == 992  # the prompt's last whole page
    assert p.chunk_end(992, 1000, 1000) == 1000
    assert p.deterministic_cuts(1000, 1000, 256) == {256, 512, 768, 992, 1000}
    assert p.deterministic_cuts(100, 100, 32) == {32, 64, 96, 100}


@pytest.mark.parametrize("deterministic", [False, True])
def test_prefill_with_the_cache_on_takes_no_more_steps_unless_deterministic(deterministic):
    """Checkpoints ride on the chunks a prompt runs anyway; the one at its last whole page is
    written inside the chunk that passes it (batch.Capture): a 500-token prompt with 128-token
    chunks prefills in 4 steps with the cache on or off. Deterministic mode cuts every prompt's
    chunk there, cache or not (the cuts are position-only, so that a hit and a cold run cut the
    same chunks): 5 steps either way. (Before, the cache on cut there in every mode: 5 steps
    against 4; cutting at every 64-token boundary took 8.)"""
    from engine_helpers import HYBRID, make_engine, tiny_model
    from hyrax.actors.engine.request import SamplingParams

    steps = {}
    for cache in (False, True):
        e = make_engine(tiny_model(HYBRID), prefix_cache=cache, deterministic=deterministic, prefill_chunk=128,
                        max_batch_tokens=512, page_size=16, mamba_track_interval=64, kv_capacity_tokens=2048)
        e.add_request(list(range(3, 83)) * 6 + list(range(3, 23)), SamplingParams(max_tokens=1))
        n = 0
        while e.has_unfinished():
            e.step()
            n += 1
        steps[cache] = n
        if cache:
            assert e.stats.prefix.checkpoints == 4  # at 128, 256, 384 and the last whole page, 496
            assert e.caching.tree.match(list(range(3, 83)) * 6 + list(range(3, 23)), None).length == 496
    assert steps == ({False: 5, True: 5} if deterministic else {False: 4, True: 4}), steps
