"""Mamba track-boundary bookkeeping under overlap scheduling (the third seed's race, as a test).

A request prefills in chunks and decodes one token per step; the next step is planned while the
previous one runs, and results are processed one step late. Every committed checkpoint goes to
the prefix cache right away; the test checks that each cached slot holds the state of exactly
the prefix it is cached under (also after later steps ran: nothing overwrites it), that no
boundary is missed, and that a later request's hit replays the right state. Two mutants show
the test can fail: result processing that reads the track's live fields, and a single "slot
being written" reused by every write (the seed's merged pointer).
"""
from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hyrax.actors.engine.mamba_track import CheckpointSlots, MambaTrack, TrackPolicy
from hyrax.actors.engine.prefix_cache import CACHE_OWNER, Checkpoint, checkpoint_pool, transfer
from prefix_cache_world import World


class LiveFieldsTrack(MambaTrack):
    """Mutant (the seed's bug): result processing ignores the step's snapshot and commits the
    write the track planned last, which under overlap belongs to the next step."""

    def commit(self, st, w):
        return super().commit(st, st.pending[-1])


class SharedSlotTrack(MambaTrack):
    """Mutant (the seed's merged pointer): a write planned while an earlier one is still pending
    reuses that write's slots ("the slot being written"), so the step planned ahead writes the
    slots whose checkpoint the cache is about to take, or has taken."""

    def plan(self, st, req_id, start, end, prompt_len, take):
        if not st.pending:
            return super().plan(st, req_id, start, end, prompt_len, take)
        busy = st.pending[-1].slots
        return super().plan(st, req_id, start, end, prompt_len, lambda n: [busy] * n)


def step_ends(policy: TrackPolicy, prompt_len: int, total: int, chunk: int) -> list[int]:
    """Prefill chunks of at most `chunk` tokens (ending on every boundary unless the policy
    checkpoints inside a step), then one token a step."""
    ends, pos = [], 0
    while pos < prompt_len - 1:
        cut = prompt_len if policy.inside else policy.next_boundary(pos, prompt_len)
        pos = min(pos + chunk, cut, prompt_len)
        ends.append(pos)
    return ends + list(range(max(pos, 0) + 1, total + 1))


def drive(track: MambaTrack, w: World, ids: tuple[int, ...], prompt_len: int, chunk: int, overlap: bool,
          lands_first: bool) -> set[int]:
    """Runs request "r" over `ids` and returns the positions cached for it. Asserts, at every
    commit, that the committed slots hold the state of the prefix they are cached under, and at
    the end that every cached slot still does."""
    ps, n_pages = w.ps, -(-len(ids) // w.ps)
    full = w.alloc["full_kv"].allocate("r", n_pages)
    swa = w.alloc["swa_kv"].allocate("r", n_pages)
    own = {"full_kv": list(full), "swa_kv": list(swa)}

    def take(n):
        out = []
        for _ in range(n):
            got = {name: w.alloc[checkpoint_pool(name)].allocate("r", 1)[0] for name in w.slot_names}
            out.append(CheckpointSlots.of(got))
        return out

    s = track.start()
    cached, locked = {}, []

    def still_cached():  # nothing written since replaced a cached state
        for position, slots in cached.items():
            for name, slot in slots.items():
                assert w.content.get((checkpoint_pool(name), slot)) == ids[:position], \
                    f"the checkpoint cached at {position} holds another prefix's state"

    def land(end, writes):  # the ranks finish a step: rows up to `end`, and its checkpoints
        for k in range((end - 1) // ps + 1):
            rows = tuple((p, ids[p]) for p in range(k * ps, min((k + 1) * ps, end)))
            w.content[("full_kv", full[k])] = w.content[("swa_kv", swa[k])] = rows
        for write in writes:
            for name, slot in write.slots.units:
                w.content[(checkpoint_pool(name), slot)] = ids[:write.position]

    def process(planned):
        nonlocal s
        writes = []
        for write in planned:
            s, done = track.commit(s, write)
            writes.append(done)
        still_cached()
        cks = {}
        for write in writes:
            for name, slot in write.slots.units:
                assert w.content.get((checkpoint_pool(name), slot)) == ids[:write.position], \
                    f"the checkpoint cached at {write.position} holds another prefix's state"
            cks[write.position] = Checkpoint(write.slots.as_dict())
        if not cks:
            return
        ins = w.cache.insert(ids[:max(cks)], {"full_kv": full}, {"swa_kv": swa}, cks)
        assert not ins.rejected
        transfer(w.alloc, ins.adopted, "r", CACHE_OWNER)
        for pool, units in ins.adopted.items():
            own[pool] = [u for u in own.get(pool, []) if u not in set(units)]
        w.cache.lock(ins.node)
        locked.append(ins.node)
        cached.update({p: ck.slots for p, ck in cks.items()})

    in_flight = None
    pos = 0
    for end in step_ends(track.policy, prompt_len, len(ids), chunk):
        s, writes = track.plan(s, "r", pos, end, prompt_len, take)
        pos = end
        if not overlap:
            land(end, writes)
            process(writes)
            continue
        if in_flight is not None:  # step N+1 is planned; N finishes, N+1 starts, N's results are processed
            land(*in_flight)
            if lands_first:
                land(end, writes)  # N+1 already wrote by the time N's results are read
            process(in_flight[1])
        in_flight = (end, writes)
    if in_flight is not None:
        land(*in_flight)
        process(in_flight[1])
    still_cached()
    for slots_left in track.release(s):
        for name, slot in slots_left.units:
            w.free(checkpoint_pool(name), [slot], "r")
    for pool, units in own.items():
        w.free(pool, units, "r")
    for node in locked:
        w.cache.unlock(node)
    return set(cached)


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


@pytest.mark.parametrize("mutant,lands_first", [(LiveFieldsTrack, False), (SharedSlotTrack, False),
                                                 (SharedSlotTrack, True)])
def test_mutation_the_race_test_fails_on_live_fields_or_a_shared_slot(mutant, lands_first):
    """A write's position and slots travel together, so committing the live (next step's)
    write can only go wrong when that step has not written yet (not lands_first): it files an
    unwritten slot. A slot shared between writes goes wrong in both interleavings."""
    w = World(page_size=4, interval=8, window=10)
    with pytest.raises(AssertionError, match="holds another prefix's state"):
        drive(mutant(w.policy), w, IDS, PROMPT_LEN, 8, True, lands_first)


def test_without_overlap_the_mutants_cache_only_right_states():
    """Sanity for the mutation check: without overlap nothing is planned ahead of the step being
    processed, so either mutant caches every boundary with its right state - what breaks them is
    processing one step late."""
    for cls in (LiveFieldsTrack, SharedSlotTrack):
        w = World(page_size=4, interval=8, window=10)
        assert drive(cls(w.policy), w, IDS, PROMPT_LEN, 8, False, False) == expected_positions(w.policy)
        w.check()


def test_every_write_owns_fresh_slots_and_too_few_go_to_the_last_positions():
    track = MambaTrack(TrackPolicy(4, 4, inside=True))
    free = [CheckpointSlots.of({"m": k}) for k in range(5)]

    def take(n):
        got, free[:] = free[:n], free[n:]
        return got

    s = track.start()
    s, a = track.plan(s, "r", 0, 12, 100, take)  # passes 4 and 8, ends on 12
    assert [(x.position, x.slots.as_dict()["m"]) for x in a] == [(4, 0), (8, 1), (12, 2)]
    s, b = track.plan(s, "r", 12, 26, 100, take)  # 16, 20, 24: two slots left, the later positions get them
    assert [(x.position, x.slots.as_dict()["m"]) for x in b] == [(20, 3), (24, 4)] and s.skipped == 1
    s, c = track.plan(s, "r", 26, 27, 100, take)
    assert c == () and s.planned == 27 and s.skipped == 1  # no boundary reached
    s, d = track.plan(s, "r", 27, 28, 100, take)
    assert d == () and s.skipped == 2  # the pool is empty: skipped, nothing overwritten
    assert {x.slots for x in a + b} == set(track.release(s))  # every pending write's slots, once
    s, done = track.commit(s, a[0])
    assert done == a[0]
    with pytest.raises(ValueError):
        track.commit(s, a[0])  # committed twice
    with pytest.raises(ValueError):
        track.plan(s, "r", 5, 6, 100, take)  # not where the track is
    assert a[0].slots not in track.release(s)  # committed: the cache's (or freed), no longer the track's


def test_policy_boundaries_and_validation():
    p = TrackPolicy(8, 4)
    assert [x for x in range(1, 30) if p.is_boundary(x, 22)] == [8, 16, 20, 24]
    assert p.writes_at(0, 24, 22) == (24,) and p.writes_at(0, 23, 22) == ()  # only where a step ends
    inside = TrackPolicy(8, 4, inside=True)
    assert inside.writes_at(0, 23, 22) == (8, 16, 20)  # every boundary it passes, in order
    assert inside.writes_at(16, 17, 22) == () and inside.writes_at(19, 20, 22) == (20,)
    assert inside.writes_at(3, 40, 40) == (8, 16, 24, 32, 40)  # the prompt's end is a multiple: once
    assert p.next_boundary(16, 22) == 20 and p.next_boundary(20, 22) == 24 and p.next_boundary(0, 5) == 4
    with pytest.raises(ValueError):
        TrackPolicy(6, 4)


@settings(max_examples=60, deadline=None)
@given(chunk=st.integers(1, 12), prompt=st.integers(2, 30), overlap=st.booleans(), lands_first=st.booleans(),
       interval=st.sampled_from([4, 8, 12]), inside=st.booleans())
def test_any_chunking_and_interleaving_caches_every_boundary_with_its_own_state(chunk, prompt, overlap,
                                                                               lands_first, interval, inside):
    w = World(page_size=4, interval=interval, window=7)
    w.policy = replace(w.policy, inside=inside)  # inside: chunks end anywhere, several writes a step
    ids = tuple(range(700, 700 + prompt + 9))
    cached = drive(MambaTrack(w.policy), w, ids, prompt, chunk, overlap, lands_first)
    assert cached == {p for p in range(1, len(ids) + 1) if w.policy.is_boundary(p, prompt)}
    w.check()
    w.evict()
    assert w.at_baseline()


def test_only_the_prompts_last_whole_page_cuts_a_chunk():
    p = TrackPolicy(interval=64, page_size=16)
    assert p.chunk_end(0, 256, 1000) == 256  # crosses 64, 128, 192: not cut (a checkpoint at 256)
    assert p.chunk_end(768, 1000, 1000) == 992  # the prompt's last whole page
    assert p.chunk_end(992, 1000, 1000) == 1000
    assert p.deterministic_cuts(1000, 1000, 256) == {256, 512, 768, 992, 1000}
    assert p.deterministic_cuts(100, 100, 32) == {32, 64, 96, 100}


@pytest.mark.parametrize("deterministic", [False, True])
def test_prefill_with_the_cache_on_takes_no_more_steps_unless_deterministic(deterministic):
    """Checkpoints ride on the chunks a prompt runs anyway; those at boundaries inside a chunk
    (every 64 tokens, and its last whole page) are written by the forward (batch.Capture): a
    500-token prompt with 128-token chunks prefills in 4 steps with the cache on or off. Deterministic mode cuts every prompt's
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
            # deterministic: where chunks end (128, 256, 384, the last whole page 496); otherwise
            # also the 64-token boundaries inside them (64, 192, 320, 448)
            assert e.stats.prefix.checkpoints == (4 if deterministic else 8)
            assert e.caching.tree.match(list(range(3, 83)) * 6 + list(range(3, 23)), None).length == 496
    assert steps == ({False: 5, True: 5} if deterministic else {False: 4, True: 4}), steps
