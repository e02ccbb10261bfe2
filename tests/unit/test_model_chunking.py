"""Whole-model logits do not depend on how a sequence is cut into steps or packed with others."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.batch import SeqSlice
from tiny_models import LAYOUTS, fresh_pools, random_model, run_in_chunks, shuffled_pages, slots_for, step, tiny_config

TOL = 1e-9
T = 19  # crosses several SSD chunks (4), pages (4) and windows (5)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(1, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module", params=list(LAYOUTS))
def model(request):
    return random_model(tiny_config(request.param), dtype=torch.float64)


@pytest.mark.parametrize(
    "chunks", [[7, 5, 3, 1, 1, 1, 1], [6] + [1] * (T - 6), [1] * T],
    ids=["uneven_chunks", "prefill_then_decode", "token_by_token"],
)
def test_logits_are_the_same_however_the_prompt_is_chunked(model, chunks):
    toks = tokens(T, seed=0)
    whole = run_in_chunks(model, toks, [T])
    got = run_in_chunks(model, toks, chunks, seed=1)  # other pages, same maths
    torch.testing.assert_close(got, whole, atol=TOL, rtol=0)


def test_packed_sequences_of_different_lengths_match_running_each_alone(model):
    lens = [11, 4, 17]
    toks = [tokens(n, seed=10 + b) for b, n in enumerate(lens)]
    alone = [run_in_chunks(model, t, [len(t)]) for t in toks]
    pools = fresh_pools(model)
    # distinct pages (one shuffled table split three ways) and distinct slots per sequence
    pages = shuffled_pages(model, 15, seed=7)
    tables = [{k: v[5 * b : 5 * b + 5] for k, v in pages.items()} for b in range(3)]
    pos, outs = [0, 0, 0], [[], [], []]
    # a packed prefill, a step mixing a prefill chunk with decodes, then packed decodes
    for take in ([6, 2, 9], [1, 1, 8], [1, 1, 0], [1, 0, 0], [1, 0, 0], [1, 0, 0]):
        live = [b for b in range(3) if take[b]]
        seqs = [SeqSlice(toks[b][pos[b] : pos[b] + take[b]], pos[b], tables[b], slots_for(model, b)) for b in live]
        logits = step(model, pools, seqs)
        for i, b in enumerate(live):
            outs[b].append(logits[i, : take[b]])
            pos[b] += take[b]
    assert pos == lens
    for b in range(3):
        torch.testing.assert_close(torch.cat(outs[b]), alone[b], atol=TOL, rtol=0)


def test_chunking_check_notices_a_lost_mamba_state():
    """Mutation check: continuing from a fresh Mamba slot mid-sequence must change the logits."""
    model = random_model(tiny_config("full_swa_mamba"), dtype=torch.float64)
    toks = tokens(T, seed=0)
    whole = run_in_chunks(model, toks, [T])
    pools = fresh_pools(model)
    pages = shuffled_pages(model, 5, seed=1)
    step(model, pools, [SeqSlice(toks[:10], 0, pages, slots_for(model, 1))])
    rest = step(model, pools, [SeqSlice(toks[10:], 10, pages, slots_for(model, 2))])[0]  # wrong slot
    assert (rest - whole[10:]).abs().max() > 1e-3
