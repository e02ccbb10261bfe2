"""A window component's pages go back as soon as their last row leaves the window, also on
one-token decode steps, which check for that only when the window's first live row moves to a
new page (`Results._frees_page`): after every step, no running request holds a window page
before its first live row."""
from __future__ import annotations

import pytest

from engine_helpers import HYBRID, greedy, make_engine, make_prompts, run_requests, tiny_model


def _held_before_window(engine) -> list[tuple[str, str, int]]:
    out = []
    for req in engine.running:
        for c in engine.results.windows:
            gone = (req.num_computed - c.live_rows(req.num_computed)) // engine.config.page_size
            out += [(req.id, c.name, n) for n in range(gone) if req.indices[c.name][n] >= 0]
    return out


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("prefix_cache", [False, True])
def test_no_window_page_outlives_its_rows(overlap, prefix_cache):
    engine = make_engine(tiny_model(HYBRID), overlap=overlap, prefix_cache=prefix_cache, deterministic=False)
    seen = []
    inner = engine.step

    def step():
        out = inner()
        seen.extend(_held_before_window(engine))
        return out
    engine.step = step
    run_requests(engine, make_prompts(6, seed=2, lo=2, hi=20), greedy(48))
    assert seen == []


@pytest.mark.parametrize("keeps", [(7,), (15,), (3, 16), (0, 31, 5)])
def test_block_rows_that_free_a_page_are_the_scalar_rule(keeps):
    """The decode block's rows whose step frees a window page (`Results._frees_pages`, the rule
    inline for one window) are exactly those for which the per-row rule (`_frees_page`) holds,
    for one and for several window lengths, on positions around every page boundary."""
    import numpy as np

    engine = make_engine(tiny_model(HYBRID), deterministic=False)
    results = engine.results
    results._keep = keeps
    starts = np.arange(0, 4 * results.page_size + 40, dtype=np.int64)
    rng = np.random.default_rng(0)
    for order in (starts.tolist(), rng.permutation(starts).tolist()):
        want = {k for k, s in enumerate(order) if results._frees_page(s)}
        assert want  # the positions cross pages: some rows free one
        assert set(results._frees_pages(order)) == want
        for n in (1, 5, 39):
            assert set(results._frees_pages(order[:n])) == {k for k in want if k < n}
    for few in ([0, 1], [0] * 40):
        assert results._frees_pages(few) == ()
