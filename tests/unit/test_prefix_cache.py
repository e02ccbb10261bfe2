"""The hybrid prefix cache's radix tree (hyrax/actors/engine/prefix_cache.py) with real
IndexAllocators: hits, window rows, checkpoints, locks, LRU eviction and the invariants."""
from __future__ import annotations

import pytest

from hyrax.actors.engine.prefix_cache import CACHE_OWNER, Checkpoint, PrefixCacheError, checkpoint_pool
from prefix_cache_world import World, cached_prefixes

PROMPT = tuple(range(100, 125))  # 25 tokens: page size 4, interval 8 -> checkpoints at 8, 16, 24


def test_hit_is_the_longest_cached_prefix_that_ends_on_a_checkpoint():
    w = World()
    w.run("a", PROMPT)
    w.finish("a")
    assert cached_prefixes(w.cache) == {PROMPT[:8], PROMPT[:16], PROMPT[:24]}
    for n, expected in [(3, 0), (8, 8), (15, 8), (16, 16), (23, 16), (24, 24), (25, 24)]:
        m = w.cache.match(PROMPT[:n])
        assert m.length == expected, n
        if expected:
            w.verify_hit(PROMPT[:n] + (0,), m)
    assert w.cache.match(PROMPT[:12] + (1,) * 12).length == 8  # diverges inside the second edge
    w.check()


def test_diverging_prompt_splits_the_edge_and_both_branches_hit():
    w = World()
    w.run("a", PROMPT)
    other = PROMPT[:20] + (7,) * 9  # shares 5 pages, diverges after position 20 (no checkpoint there)
    h = w.run("b", other)
    assert h.hit == 16
    w.check()
    w.finish("a"), w.finish("b")
    # other's checkpoints: 24 (interval) and 28 (its last whole page); 16 is shared
    assert cached_prefixes(w.cache) == {PROMPT[:8], PROMPT[:16], PROMPT[:24], other[:24], other[:28]}
    assert w.cache.match(other).length == 28 and w.cache.match(PROMPT).length == 24
    w.verify_hit(other, w.cache.match(other[:-1]))
    w.check()
    assert w.drained()


def test_window_rows_are_kept_only_where_a_checkpoint_needs_them():
    w = World(page_size=4, interval=16, window=6)  # a hit at E needs positions E-5..E-1
    long = tuple(range(200, 241))  # 41 tokens: checkpoints at 16, 32, 40
    w.run("a", long)
    w.finish("a")
    held = sorted(w.cache.held()["swa_kv"])
    assert len(held) == len({2, 3, 6, 7, 8, 9})  # pages of positions 11..15, 27..31, 35..39
    w.check()


def test_referenced_nodes_survive_eviction_and_unreferenced_ones_go_entirely():
    w = World()
    w.run("a", PROMPT)
    assert w.evict() == {}  # "a" still runs on its cached prefix
    w.check()
    w.finish("a")
    freed = w.evict()
    assert {p: len(u) for p, u in freed.items()} == {"full_kv": 6, "swa_kv": 6, "mamba_conv.checkpoint": 3,
                                                     "mamba_ssm.checkpoint": 3}
    assert w.at_baseline() and not list(w.cache.nodes())
    w.check()


def test_a_hit_keeps_its_prefix_while_other_branches_are_evicted():
    w = World()
    w.run("a", PROMPT)
    w.finish("a")
    w.run("b", PROMPT[:16] + (9,) * 10)  # hit 16, locks 0..16 and its own branch
    w.evict()
    left = cached_prefixes(w.cache)
    assert PROMPT[:16] in left and PROMPT[:24] not in left
    w.check()
    w.finish("b")
    assert w.drained()


def test_eviction_is_least_recently_used_first_and_stops_when_the_need_is_met():
    w = World()
    x, y = (1,) * 9, (2,) * 9  # one 8-token node each
    w.run("x", x), w.finish("x")
    w.run("y", y), w.finish("y")
    w.cache.match(x)  # x is now the most recently used
    freed = w.evict({"full_kv": 1})
    assert len(freed["full_kv"]) == 2  # a whole node: both of its pages, with its checkpoint
    assert cached_prefixes(w.cache) == {x[:8]}
    w.check()


def test_a_second_identical_prompt_hits_and_keeps_the_prefix_alive():
    w = World()
    w.run("a", PROMPT)
    b = w.run("b", PROMPT)
    assert b.hit == 24
    w.finish("a")
    w.check()
    w.evict()  # b still holds the prefix
    assert w.cache.match(PROMPT).length == 24
    w.finish("b")
    assert w.drained()


def test_duplicate_checkpoints_are_rejected_and_stay_with_the_caller():
    w = World()
    w.run("a", PROMPT)
    # a second request that computed the same prefix itself (no hit) offers its own units
    full = w.alloc["full_kv"].allocate("b", 6)
    swa = w.alloc["swa_kv"].allocate("b", 6)
    slots = {n: w.alloc[checkpoint_pool(n)].allocate("b", 1)[0] for n in w.slot_names}
    ins = w.cache.insert(PROMPT, {"full_kv": full}, {"swa_kv": swa}, {24: Checkpoint(slots)})
    # the cached path lies in a's pages: b is told to read those (and give its copies back) under
    # the lock of a's node, so that it never pins a copy it does not read
    assert ins.rejected == (24,) and ins.adopted == {} and ins.length == 24 and ins.node is w.requests["a"].locked[-1]
    assert ins.reuse == {"full_kv": dict(enumerate(w.cache.match(PROMPT).full["full_kv"]))}
    w.cache.lock(ins.node)
    w.check()
    for pool, units in (("full_kv", full), ("swa_kv", swa)):
        w.free(pool, units, "b")
    for n, s in slots.items():
        w.free(checkpoint_pool(n), [s], "b")
    w.finish("a")
    w.evict()
    assert w.cache.match(PROMPT).length == 24  # b reads it still
    w.let_go(w.cache.unlock(ins.node))
    assert w.drained()


def test_a_checkpoint_whose_window_rows_are_gone_is_not_cached():
    w = World()
    full = w.alloc["full_kv"].allocate("r", 4)
    swa = [-1, -1, -1, w.alloc["swa_kv"].allocate("r", 1)[0]]  # the window released pages 0..2
    slots = {n: w.alloc[checkpoint_pool(n)].allocate("r", 1)[0] for n in w.slot_names}
    ins = w.cache.insert(tuple(range(16)), {"full_kv": full}, {"swa_kv": swa}, {16: Checkpoint(slots)})
    assert ins.rejected == (16,) and ins.length == 0 and ins.adopted == {}
    assert not list(w.cache.nodes())  # the grown tail had no checkpoint left: pruned
    w.check()


def test_insert_refuses_a_prefix_without_a_checkpoint_or_with_unaligned_ones():
    w = World()
    with pytest.raises(ValueError):
        w.cache.insert(PROMPT, {"full_kv": [0] * 7}, {}, {})
    with pytest.raises(ValueError):
        w.cache.insert(PROMPT, {"full_kv": [0] * 7}, {}, {10: Checkpoint({"mamba_conv": 0, "mamba_ssm": 0})})
    with pytest.raises(ValueError):
        w.cache.insert(PROMPT, {"full_kv": [0] * 7}, {}, {8: Checkpoint({"mamba_conv": 0})})


def test_split_of_a_locked_edge_keeps_reference_counts():
    w = World(interval=16)
    w.run("a", PROMPT[:17])  # one node 0..16, locked by "a"
    w.run("b", PROMPT[:8] + (5,) * 9)  # diverges at 8: splits a's locked edge
    w.check()
    w.finish("a")
    w.check()
    w.finish("b")
    assert w.drained()


def test_check_invariants_notices_a_leaked_unit_a_wrong_ref_and_a_foreign_owner():
    w = World()
    w.run("a", PROMPT)
    w.check()
    leaked = w.alloc["full_kv"].allocate(CACHE_OWNER, 1)
    with pytest.raises(PrefixCacheError, match="allocator says"):
        w.check()
    w.alloc["full_kv"].free(CACHE_OWNER, leaked)
    node = w.requests["a"].locked[-1]
    node.ref += 1
    with pytest.raises(PrefixCacheError, match="ref"):
        w.check()
    node.ref -= 1
    unit = w.cache.held()["full_kv"][0]
    w.alloc["full_kv"].free(CACHE_OWNER, [unit])
    w.alloc["full_kv"].claim("someone-else", (unit,))
    with pytest.raises(PrefixCacheError, match="allocator says"):
        w.check()


def test_unlock_without_lock_and_lock_without_checkpoint_are_errors():
    w = World()
    w.run("a", PROMPT)
    w.finish("a")
    node = w.cache.match(PROMPT).node
    with pytest.raises(PrefixCacheError):
        w.cache.unlock(node)
    with pytest.raises(PrefixCacheError):
        w.cache.lock(w.cache.root)
    w.evict()
    with pytest.raises(PrefixCacheError, match="evicted"):
        w.cache.lock(node)  # a Match kept past an eviction cannot pin what is gone


def test_a_hit_never_ends_on_a_split_point_without_a_checkpoint():
    w = World(interval=8)
    w.run("a", PROMPT), w.finish("a")
    w.run("b", PROMPT[:12] + (3,) * 9), w.finish("b")  # splits at 12: node 8..12 has no checkpoint
    assert w.cache.match(PROMPT[:14]).length == 8
    assert w.cache.match(PROMPT[:12] + (3,)).length == 8
    w.check()


def test_evicting_a_branch_frees_the_window_pages_above_it_that_only_it_needed():
    w = World(page_size=4, interval=16, window=10)  # a hit at E needs positions E-9..E-1
    a = tuple(range(300, 333))  # checkpoints at 16 and 32
    b = a[:24] + (1,) * 5  # 29 tokens: checkpoints at 16 and 28
    w.run("a", a)
    w.run("b", b), w.finish("b")
    page4 = w.cache.match(b[:28] + (0,)).window["swa_kv"][4]  # positions 16..19: only b's checkpoint needs it
    assert page4 in w.cache.held()["swa_kv"]
    w.evict()  # a is running: only b's leaf goes
    assert page4 not in w.cache.held()["swa_kv"]
    w.check()
    w.finish("a")
    assert w.drained()


def test_retract_abort_or_hand_off_of_a_hit_frees_only_its_own_units():
    """Retraction, abort and hand-off all leave through the same free: the request's own units
    and its locks. What the tree or another request references stays, intact, and the request
    hits again when it comes back (a restore after retraction, a re-prefill after a fallback)."""
    w = World()
    w.run("a", PROMPT), w.finish("a")
    b = w.run("b", PROMPT[:20] + (4,) * 6)
    c = w.run("c", PROMPT[:18] + (6,) * 6)
    assert b.hit == c.hit == 16
    shared = w.cache.match(PROMPT[:17]).full["full_kv"]
    w.finish("b")  # retracted (its backup holds copies), aborted, or handed off: the same free
    w.check()
    assert w.cache.match(PROMPT[:17]).full["full_kv"] == shared
    w.verify_hit(PROMPT[:17], w.cache.match(PROMPT[:16]))
    again = w.run("b", PROMPT[:20] + (4,) * 6)  # resumed by re-prefill: hits its own earlier insert
    assert again.hit == 24
    w.finish("b"), w.finish("c")
    assert w.drained()


def test_evict_refuses_a_pool_the_tree_does_not_hold():
    w = World()
    with pytest.raises(ValueError, match="no units"):
        w.cache.evict({"mamba_ssm": 1})  # the request slots: the tree holds checkpoints, not these
