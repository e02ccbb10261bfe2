"""Checkpoints on a path a running request locks, whose window pages nobody reads any more, go
under window pressure (`Eviction._evict_locked_checkpoints`): a request's lock pins the token
pages it reads, not the window pages it left behind. Real IndexAllocators (prefix_cache_world)."""
from __future__ import annotations

import dataclasses

from hyrax.actors.engine.prefix_cache import InUse
from prefix_cache_world import World, cached_prefixes

LONG = tuple(range(200, 241))  # 41 tokens: page size 4, interval 8 -> checkpoints at 8, 16, 24, 32, 40


def _node(w: World, end: int):
    return next(n for n in w.cache.nodes() if n.end == end)


def test_a_running_requests_checkpoints_behind_its_window_go_with_their_pages():
    """Window 6: the checkpoint at E needs pages (E-5)//4..(E-1)//4, two apiece. "a" runs on
    (locking 40, so its whole path) and reads pages 9 and 10; the pages of 8..32 it left behind
    go, with their checkpoints, shallowest first, as the need asks; 40's stay (it reads 9)."""
    w = World(page_size=4, interval=8, window=6)
    w.run("a", LONG)
    assert cached_prefixes(w.cache) == {LONG[:e] for e in (8, 16, 24, 32, 40)}
    freed = w.evict({"swa_kv": 4})
    assert {p: len(u) for p, u in freed.items()} == {"swa_kv": 4, "mamba_conv.checkpoint": 2,
                                                     "mamba_ssm.checkpoint": 2}
    assert cached_prefixes(w.cache) == {LONG[:e] for e in (24, 32, 40)}
    assert w.cache.match(LONG[:23]).length == 0  # no hit claims the window state that went
    w.check()  # also: every page "a" reads still holds its rows
    freed = w.evict({"swa_kv": 10})
    assert len(freed["swa_kv"]) == 4 and cached_prefixes(w.cache) == {LONG[:40]}
    m = w.cache.match(LONG[:40] + (0,))
    assert m.length == 40
    w.verify_hit(LONG[:40] + (0,), m)
    w.check()
    w.finish("a")
    assert w.drained()


def test_a_hit_still_to_copy_keeps_its_checkpoint_and_window():
    w = World(page_size=4, interval=8, window=6)
    w.run("a", LONG)
    copying = _node(w, 16)
    w.let_go(w.cache.evict({"swa_kv": 8}, dataclasses.replace(w.in_use(), hits=frozenset({copying}))))
    assert cached_prefixes(w.cache) == {LONG[:16], LONG[:40]}
    w.verify_hit(LONG[:17], w.cache.match(LONG[:17]))
    w.check()
    w.finish("a")
    assert w.drained()


def test_a_locked_node_that_lost_its_checkpoint_leaves_with_its_last_lock():
    """Once "a" read none of its window pages (as after decoding past them), even the node it
    locks loses its checkpoint under pressure; it stays for "a"'s token pages and goes, with
    the path above, when "a" unlocks it."""
    w = World(page_size=4, interval=8, window=6)
    h = w.run("a", LONG)
    w.let_go(w.cache.evict({"swa_kv": 100}, InUse()))
    assert cached_prefixes(w.cache) == set() and h.locked[-1].parent is not None
    assert w.cache.match(LONG).length == 0
    w.cache.check_invariants(w.alloc)  # a locked leaf without a checkpoint is allowed
    w.finish("a")  # gives back what the unlock returned
    w.cache.check_invariants(w.alloc)
    assert w.at_baseline() and not list(w.cache.nodes())


def test_a_checkpoint_taken_off_in_vain_is_put_back():
    """Window 6, interval 4: neighbouring checkpoints share a page. "a"'s checkpoint at 8 was
    written after its prompt (it goes first) but frees nothing (pages 0 and 1 are also 4's and
    12's); "b"'s at 4 and 8 then free page 0 of b's. 8 of "a" lost no page: it stays a hit."""
    w = World(page_size=4, interval=4, window=6)
    b, a = tuple(range(400, 417)), tuple(range(300, 317))  # 17 tokens: checkpoints 4, 8, 12, 16
    w.run("b", b)
    w.run("a", a)
    eight = w.cache.match(a[:9], touch=False).node
    eight.checkpoint = dataclasses.replace(eight.checkpoint, in_prompt=False)
    freed = w.evict({"swa_kv": 1})
    assert len(freed["swa_kv"]) == 1
    assert cached_prefixes(w.cache) == {a[:4], a[:8], a[:12], a[:16], b[:12], b[:16]}
    w.verify_hit(a[:9], w.cache.match(a[:9]))
    w.check()
    w.finish("a"), w.finish("b")
    assert w.drained()
