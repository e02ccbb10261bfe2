"""Random insert / match / lock / unlock / evict sequences against a reference model (the cached
prefixes and where the tree's nodes end), with real IndexAllocators; every pool ends at its
baseline."""
from __future__ import annotations

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from prefix_cache_world import World, cached_prefixes, node_ends

STEMS = (tuple(range(10, 30)), tuple(range(10, 22)) + (1,) * 8, (5,) * 20)

prompts = st.builds(lambda stem, cut, tail: STEMS[stem][:cut] + tuple(tail),
                    st.integers(0, len(STEMS) - 1), st.integers(0, 20),
                    st.lists(st.integers(0, 3), min_size=1, max_size=10))
ops = st.lists(st.one_of(
    st.tuples(st.just("run"), prompts),
    st.tuples(st.just("finish"), st.integers(0, 7)),
    st.tuples(st.just("match"), prompts),
    st.tuples(st.just("match_seen"), st.integers(0, 30), st.integers(1, 30), st.integers(0, 3)),
    st.tuples(st.just("evict"), st.sampled_from(["full_kv", "swa_kv", "mamba_ssm.checkpoint"]), st.integers(1, 6)),
    st.tuples(st.just("flush")),
), max_size=30)


def expected_hit(reference: set, q: tuple) -> int:
    return max((len(p) for p in reference if len(p) <= len(q) and q[:len(p)] == p), default=0)


def common(a: tuple, b: tuple, ps: int) -> int:
    """Length of the common prefix of a and b, in whole pages."""
    k = 0
    while k + ps <= min(len(a), len(b)) and a[k:k + ps] == b[k:k + ps]:
        k += ps
    return k


def inserted(reference: set, ends: set, ids: tuple, cuts: list[int], ps: int) -> tuple[list[int], set]:
    """The checkpoint positions of `cuts` (all after the run's hit) its insert caches, and the
    node ends the tree gains. The insert follows the tree as far as it holds ids, whoever computed
    those pages (the run then reads the tree's copy: docs/prefix-cache.md), and caches every
    checkpoint not cached already (a run never lacks window rows here); the tree gains a node at
    each cut, and a split where the run leaves a cached edge before its last cut."""
    reach = max((common(e, ids, ps) for e in ends), default=0)  # how far the tree holds ids
    grown = {ids[:p] for p in cuts} | ({ids[:reach]} if 0 < reach < cuts[-1] else set())
    return [p for p in cuts if ids[:p] not in reference], grown


# Three topologies random sequences rarely reach, pinned: a query that fully covers a split point
# without a checkpoint (a hit must stop at the checkpoint above it); a branch whose window rows
# reach into an ancestor no remaining checkpoint needs (evicting it must free them); and a prompt
# ending inside a cached edge with no hit (its checkpoint there is cached on a split of that edge,
# and the run reads the tree's copy of the page: a repeat of it hits).
SPLIT = STEMS[0][:20] + (0,), STEMS[0][:12] + (1,) * 9
REACH = tuple(range(300, 333)), tuple(range(300, 324)) + (1,) * 5
INSIDE = STEMS[0][:4] + (0,)


@example(ops=[("run", SPLIT[0]), ("run", SPLIT[1]), ("match", STEMS[0][:14])], window=10, interval=8)
@example(ops=[("run", REACH[0]), ("run", REACH[1]), ("finish", 1), ("evict", "swa_kv", 1)], window=10, interval=16)
@example(ops=[("run", STEMS[0][:7] + (0,)), ("run", INSIDE), ("run", INSIDE)], window=3, interval=8)
@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=ops, window=st.sampled_from([3, 10, 17]), interval=st.sampled_from([4, 8, 12]))
def test_random_sequences_match_the_reference_and_return_every_pool_to_baseline(ops, window, interval):
    w = World(page_size=4, interval=interval, window=window, pages=40, ckpt_slots=24)
    reference: set[tuple[int, ...]] = set()  # cached prefixes (a checkpoint at their end)
    ends: set[tuple[int, ...]] = set()  # where the tree's nodes end: those and its split points
    running: list[str] = []
    seen: list[tuple[int, ...]] = []
    for k, op in enumerate(ops):
        if op[0] == "run":
            ids = op[1]
            if len(ids) < 2 or not w.fits(ids):
                continue
            expect = expected_hit(reference, ids[:-1])
            h = w.run(f"r{k}", ids)  # verifies the hit's contents against what it would compute
            assert h.hit == expect
            running.append(f"r{k}")
            seen.append(ids)
            cuts = [p for p in range(expect + w.ps, len(ids) + 1, w.ps) if w.policy.is_boundary(p, len(ids))]
            if cuts:
                taken, grown = inserted(reference, ends, ids, cuts, w.ps)
                reference |= {ids[:p] for p in taken}
                ends |= grown
        elif op[0] == "finish" and running:
            w.finish(running.pop(op[1] % len(running)))
        elif op[0] in ("match", "match_seen"):
            if op[0] == "match_seen":  # a prefix of a prompt seen before, often ending inside an edge
                if not seen:
                    continue
                q = seen[op[1] % len(seen)][:op[2]] + (op[3],)
            else:
                q = op[1]
            m = w.cache.match(q)
            assert m.length == expected_hit(reference, q)
            if m.length:
                w.verify_hit(q[:m.length] + (0,), m)
        elif op[0] in ("evict", "flush"):
            need = {op[1]: op[2]} if op[0] == "evict" else None
            freed = w.evict(need)
            left = cached_prefixes(w.cache)
            assert left <= reference
            for rid in running:  # what a running request locked is still in the tree (its checkpoint
                h = w.requests[rid]  # may have gone with window pages nobody reads any more)
                assert all(n.parent is not None for n in h.locked)
            if need is None or any(len(freed.get(p, ())) < n for p, n in need.items()):
                assert all(n.ref > 0 for n in w.cache.nodes() if not n.children), "an evictable leaf was left"
            reference, ends = left, node_ends(w.cache)
        w.check()
    for rid in running:
        w.finish(rid)
    w.check()
    w.evict()
    assert w.at_baseline() and not list(w.cache.nodes())
