"""A rank samples a decode block's rows from the block's own columns (`SpecColumns`), without a
`SamplingSpec` per row (issue 21). What must hold: every row draws exactly the token its
`SamplingSpec` draws - alone, or in a list of specs - whatever the mix of greedy and sampled
rows, filters, seeds (any int, taken modulo 2**64) and draw indices; rows after a block keep
their logit processing, grammar and logprobs at their own row; and the vectorised uniform
numbers are the scalar function's, bit for bit."""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from hyrax.actors.engine.lane import block_of
from hyrax.actors.engine.plan import PlanEntry, SamplingSpec
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.sampler import UNIFORMS_SCALAR_BELOW, logprobs_of, process_logits, sample, uniform, uniforms
from hyrax.actors.engine.spec_columns import SpecColumns, seed_column

V = 40
SEEDS = (0, 1, -1, -(2**70) + 3, 2**63 - 1, 2**64 - 1, 2**64 + 17, 123456789)


@pytest.mark.parametrize("n", [1, UNIFORMS_SCALAR_BELOW - 1, UNIFORMS_SCALAR_BELOW, 64, 300])
def test_uniforms_are_the_scalar_function_bit_for_bit(n):
    rng = random.Random(n)
    seeds = [SEEDS[k] if k < len(SEEDS) else rng.getrandbits(64) - 2**63 for k in range(n)]
    draws = [rng.choice((0, 1, 2**40)) if k % 3 == 0 else rng.randrange(100_000) for k in range(n)]
    got = uniforms(seed_column(seeds), np.array(draws, dtype=np.int64))
    assert np.asarray(got, dtype=np.float64).tolist() == [uniform(s, d) for s, d in zip(seeds, draws)]


def _block_entries(n: int, rng: random.Random) -> list[PlanEntry]:
    """Steady decode entries with plain parameters: greedy, temperature, top-k, top-p, logprobs."""
    out = []
    for k in range(n):
        t = (0.0, 0.7, 1.0, 1.3)[k % 4]
        spec = SamplingSpec(t, (1.0, 0.8)[k % 2], (0, 5, V + 3)[k % 3], SEEDS[k % len(SEEDS)] + k, rng.randrange(50),
                            (None, 0, 3)[k % 3])
        out.append(PlanEntry(f"r{k}", (-1,), 10 + k, {"kv": (k,)}, {"ssm": k}, spec))
    return out


def _processed_specs() -> tuple[list[SamplingSpec], list[list[int]]]:
    """Entries after the block: a penalised row, a plain one, a penalised greedy one."""
    hist = [[3, 4, 4, 9], [1, 2], [5, 5, 5, 6, 7]]
    params = [SamplingParams(temperature=1.0, presence_penalty=1.5, repetition_penalty=1.3, logit_bias=((7, 4.0),)),
              SamplingParams(temperature=0.9, top_k=4, logprobs=2),
              SamplingParams(frequency_penalty=2.0, min_tokens=9, stop_token_ids=(1,))]
    return [SamplingSpec.of(p, seed=99 + i, draw=2, ids=h) for i, (p, h) in enumerate(zip(params, hist))], hist


@pytest.mark.parametrize("n", [1, 5, 33])
def test_a_block_and_entries_sample_as_their_specs(n):
    rng = random.Random(n)
    entries = _block_entries(n, rng)
    block = block_of(entries, [1000] * n, [False] * n, page_size=64)
    block_specs = [block.entry(k).sample for k in range(n)]
    assert block_specs == [e.sample for e in entries]  # the block holds what its entries held
    tail, hist = _processed_specs()
    cols = SpecColumns.of_block(block).then(SpecColumns.of(tail))
    specs = block_specs + tail
    histories = [None] * n + hist
    logits = torch.randn(n + len(tail), V, generator=torch.Generator().manual_seed(n), dtype=torch.float64) * 3

    assert len(cols) == n + 3 and cols.processed_rows == [n, n + 2]
    assert cols.asks_logprobs and cols.grammars() is None
    before = logits.clone()
    got = sample(logits, cols, histories, eos=(0,))
    assert torch.equal(logits, before)  # processing works on a copy, also of float64 logits
    assert got == sample(logits, specs, histories, eos=(0,))
    processed = process_logits(logits, specs, histories, (0,))
    alone = [sample(processed[k:k + 1], [s if s.process is None else s._replace(process=None)])[0]
             for k, s in enumerate(specs)]
    assert got == alone  # each row as it draws alone, its processing applied
    assert logprobs_of(logits, got, cols) == logprobs_of(logits, got, specs)
    assert set(logprobs_of(logits, got, cols)) == {k for k, s in enumerate(specs) if s.logprobs is not None}


def test_columns_of_an_empty_part_leave_the_other_as_it_is():
    tail, _ = _processed_specs()
    cols = SpecColumns.of(tail)
    assert SpecColumns.of([]).then(cols) is cols and cols.then(SpecColumns.of([])) is cols
    assert sample(torch.zeros(0, V), SpecColumns.of([])) == []
