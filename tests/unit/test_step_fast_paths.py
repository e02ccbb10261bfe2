"""The per-step fast paths of issue 21 (a step's CPU cost must not grow with the batch) give
what the general paths give: a window's releasable pages (one C-level scan when none is
left) and the common sampling spec (no logit processing, no grammar)."""
from __future__ import annotations

import random

import torch

from hyrax.actors.engine.plan import SamplingSpec
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.statecopy import releasable_pages
from hyrax.actors.model.components import WINDOW, ComponentSpec


def _window(window: int) -> ComponentSpec:
    return ComponentSpec("swa", WINDOW, (0,), (2, 4), torch.float32, 0, (0, 1), 2, window)


def _reference(comp: ComponentSpec, table: list[int], num_tokens: int, page_size: int) -> list[int]:
    """Every page before the first live row that the table still holds (the whole-table scan)."""
    first_live = num_tokens - comp.live_rows(num_tokens)
    return [n for n in range(first_live // page_size) if table[n] >= 0]


def test_releasable_pages_match_the_whole_table_scan():
    rng = random.Random(0)
    for _ in range(2000):
        page_size, window = rng.choice((1, 4, 16)), rng.randint(2, 40)
        comp = _window(window)
        num_tokens = rng.randint(0, 200)
        n_pages = -(-num_tokens // page_size)
        # released (-1) pages, held pages and holes anywhere: not only a released prefix
        table = [rng.choice((-1, rng.randint(0, 99))) for _ in range(n_pages)]
        assert releasable_pages(comp, table, num_tokens, page_size) == _reference(comp, table, num_tokens, page_size)


def test_common_sampling_spec_equals_the_general_construction():
    for params in (SamplingParams(max_tokens=5), SamplingParams(max_tokens=5, temperature=0.7, top_p=0.9, top_k=3),
                   SamplingParams(max_tokens=5, logprobs=2, seed=11)):
        assert not params.processes_logits and params.grammar is None
        got = SamplingSpec.of(params, 123, 4, (1, 2, 3, -1))
        assert got == SamplingSpec(params.temperature, params.top_p, params.top_k, 123, 4, params.logprobs, None, None)
    processed = SamplingSpec.of(SamplingParams(max_tokens=5, presence_penalty=0.5), 1, 1, (1, 2, -1))
    assert processed.process is not None and list(processed.process.history) == [1, 2, -1]
