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
from hyrax.actors.engine.sampler import GREEDY_BELOW, UNIFORMS_SCALAR_BELOW, logprobs_of, process_logits, sample, uniform, uniforms
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


@pytest.mark.parametrize("penalised", [False, True])
def test_a_top_k_beyond_any_vocabulary_is_no_top_k(penalised):
    """A top_k no vocabulary reaches (the API puts no bound on it) means no top-k, as one of the
    vocabulary's size does: the same tokens as top_k 0, for a plain request (planned in the
    decode block) and a penalised one (a plan entry), each beside an ordinary request - not an
    int64 overflow that fails the step, and every request in it, or the engine."""
    from engine_helpers import HYBRID, make_engine, make_prompts, run_requests, tiny_model

    extra = {"presence_penalty": 0.5} if penalised else {}
    prompts = make_prompts(2, seed=5)
    outs = {}
    for top_k in (0, 10**20, 2**63, 2**64 + 5):
        engine = make_engine(tiny_model(HYBRID))
        params = [SamplingParams(max_tokens=6, temperature=1.0, seed=1),
                  SamplingParams(max_tokens=6, temperature=1.0, seed=2, top_k=top_k, **extra)]
        outs[top_k] = run_requests(engine, prompts, params)
        assert all(r == "length" for r in engine.stats.finished if engine.stats.finished[r]), engine.stats.finished
    assert all(o == outs[0] for o in outs.values()), outs


def test_the_greedy_threshold_and_a_later_rows_top_p():
    """A temperature of exactly GREEDY_BELOW samples (two tied logits: both tokens come up over
    seeds, where greedy always takes the first); a row whose top_p < 1 filters also when the
    first sampled row's top_p is 1 (its nucleus never lets the excluded tokens through)."""
    tied = torch.zeros(1, V, dtype=torch.float64)
    tied[0, 3] = tied[0, 9] = 5.0
    got = {sample(tied, [SamplingSpec(GREEDY_BELOW, 1.0, 0, s, 0)])[0] for s in range(40)}
    assert got == {3, 9}
    row = torch.linspace(0, 3, V, dtype=torch.float64)  # token V-1 most likely
    specs = [SamplingSpec(1.0, 1.0, 0, 7, 0), SamplingSpec(1.0, 0.3, 0, 7, 0)]
    nucleus = set(range(V - 1, -1, -1)[:_nucleus_size(row, 0.3)])
    for s in range(60):
        specs[1] = specs[1]._replace(seed=s)
        assert sample(torch.stack([row, row]), specs)[1] in nucleus


def _nucleus_size(row: torch.Tensor, top_p: float) -> int:
    p = sorted(torch.softmax(row, -1).tolist(), reverse=True)
    mass = 0.0
    for k, x in enumerate(p):
        mass += x
        if mass >= top_p:
            return k + 1
    return len(p)

