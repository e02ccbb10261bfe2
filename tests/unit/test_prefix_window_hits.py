"""Prefix-cache hits of models with a sliding window: a hit takes pages for its window's live
rows (its copies of the cached ones) on top of its chunk's, and those cached pages are locked
while it waits. Each scenario runs with the cache on and off in deterministic mode: identical
tokens, the cache-on run hits, and every pool comes back to baseline (invariants after every
step, then idle-clean)."""
from __future__ import annotations

import random

import pytest

from engine_helpers import VOCAB, assert_idle_clean, greedy, make_engine, tiny_model


def _waves(waves: list[list[list[int]]], max_tokens: list[int], cache: bool, layout: str, limit: int = 300,
           **kw) -> tuple[list[tuple[list[int], str]], dict]:
    """Each wave of prompts arrives once the one before is done (its prefixes cached), the k-th
    wave's requests with `max_tokens[k]`; the outputs and finish reasons in order, and the
    cache's counters. Raises if a wave is not done within `limit` steps."""
    engine = make_engine(tiny_model(layout), prefix_cache=cache, **kw)
    ids = []
    for wave, n in zip(waves, max_tokens):
        ids += [engine.add_request(prompt, greedy(n)) for prompt in wave]
        for _ in range(limit):
            if not engine.has_unfinished() and not engine.has_inflight():
                break
            engine.step()
            engine.check_invariants()
        else:
            raise AssertionError(f"unfinished after {limit} steps: {engine.counts()}, {engine.pool_usage()}")
    assert_idle_clean(engine)
    done = [engine.finished_requests[i] for i in ids]
    return [(r.output_ids, r.finish_reason) for r in done], engine.caching.stats.summary()


def test_a_hit_whose_window_and_chunk_pages_outnumber_the_step_budget_is_planned():
    """Pages of one token, a step budget of 4 tokens: a hit at 16 takes 4 pages for its window's
    live rows (12..15) and 4 for its chunk (16..19), 8 units of the swa pool, of which the
    scheduler's view listed only the budget's 4: the step raised ("the view lists 4 free
    units, a step took more"; a replica's loop then fails every request on it)."""
    rng = random.Random(1)
    first = [rng.randrange(VOCAB) for _ in range(20)]
    then = first[:16] + [rng.randrange(VOCAB) for _ in range(6)]
    kw = dict(layout="swa_mamba", page_size=1, max_batch_tokens=4, prefill_chunk=4, mamba_track_interval=4)
    off, _ = _waves([[first], [then]], [6, 6], cache=False, **kw)
    on, stats = _waves([[first], [then]], [6, 6], cache=True, **kw)
    assert on == off
    assert stats["hits"] == 1 and stats["hit_tokens"] == 16, stats


@pytest.mark.parametrize("overlap", [False, True])
def test_waiting_hits_that_lock_the_whole_window_pool_let_go_of_it(overlap):
    """A 38-token prompt leaves 5 of the swa pool's 6 pages cached (the window's page at each
    checkpoint: 8, 16, 24, 32 and its last whole page, 36). Two prompts sharing its 37 tokens
    then hit at 32 and lock the path there (4 pages; the fifth is evicted): each needs 3 pages
    of its own (its window's live rows 28..31, copied in, and its chunk 32..39), 2 are free, and
    nothing runs to free more. They waited for good; now they let go of their hits, the cache
    is evicted and they run without them (as with the cache off)."""
    rng = random.Random(2)
    prefix = [rng.randrange(VOCAB) for _ in range(37)]
    first, *then = (prefix + [rng.randrange(VOCAB) for _ in range(k)] for k in (1, 3, 5))
    kw = dict(layout="swa", page_size=4, swa_capacity_tokens=24, max_batch_tokens=16, prefill_chunk=8,
              mamba_track_interval=8, overlap=overlap)
    off, _ = _waves([[first], then], [1, 3], cache=False, **kw)
    on, stats = _waves([[first], then], [1, 3], cache=True, **kw)
    assert on == off
    assert stats["checkpoints"] >= 5 and stats["evicted_units"]["swa_kv"] >= 2, stats


@pytest.mark.parametrize("layout", ["full_swa_mamba", "swa_mamba"])
@pytest.mark.parametrize("overlap", [False, True])
def test_window_pages_a_running_request_left_behind_do_not_starve_a_small_window_pool(layout, overlap):
    """An 8-page swa pool (window 5, pages of 4: a request reads 2-3 pages at a time), a
    checkpoint every 8 tokens. Each request passes its window many times; with the cache on, the
    tree takes the window page before each checkpoint, and the request's lock on its path kept
    every one of them (pages it no longer reads) from eviction: with three such requests the
    pool ran dry and requests ended early ("length" after 23 of 40 tokens) where the cache-off
    run finishes them. Pages nobody reads now go under pressure, with their checkpoints."""
    rng = random.Random(3)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    first = [shared + [rng.randrange(VOCAB) for _ in range(k)] for k in (10, 14)]
    first.append([rng.randrange(VOCAB) for _ in range(30)])
    then = [first[0][:30] + [rng.randrange(VOCAB) for _ in range(5)], shared + [rng.randrange(VOCAB) for _ in range(7)]]
    kw = dict(layout=layout, page_size=4, swa_capacity_tokens=32, max_batch_tokens=16, prefill_chunk=8,
              mamba_track_interval=8, overlap=overlap)
    off, _ = _waves([first, then], [40, 30], cache=False, **kw)
    assert [len(out) for out, _ in off] == [40, 40, 40, 30, 30]
    on, stats = _waves([first, then], [40, 30], cache=True, **kw)
    assert on == off
    assert stats["evicted_units"]["swa_kv"] >= 1, stats
