"""Logprobs: the chosen token's logprob and the top alternatives come from the model's
distribution, one entry per generated token, only for requests that ask."""
from __future__ import annotations

import torch

from hyrax.actors.engine.plan import SamplingSpec
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.sampler import logprobs_of, sample
from engine_helpers import HYBRID, make_engine, tiny_model


def test_logprobs_of_matches_log_softmax_and_orders_the_top_tokens():
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(2, 50, generator=g, dtype=torch.float64)
    specs = [SamplingSpec(0.0, 1.0, 0, 1, 0, 3), SamplingSpec(0.0, 1.0, 0, 1, 0, None)]
    toks = sample(logits, specs)
    out = logprobs_of(logits, toks, specs)
    ref = torch.log_softmax(logits[0], -1)
    assert set(out) == {0}
    assert abs(out[0]["logprob"] - float(ref[toks[0]])) < 1e-12
    assert [t for t, _ in out[0]["top"]] == torch.topk(ref, 3).indices.tolist()
    assert out[0]["top"][0][0] == toks[0]  # greedy: the chosen token is the most likely


def test_engine_reports_one_logprob_entry_per_token_only_when_asked():
    e = make_engine(tiny_model(HYBRID))
    a = e.add_request([1, 2, 3, 4], SamplingParams(max_tokens=5, logprobs=2))
    b = e.add_request([5, 6], SamplingParams(max_tokens=5))
    got: dict[str, list] = {a: [], b: []}
    toks: dict[str, list] = {a: [], b: []}
    while e.has_unfinished():
        for o in e.step():
            toks[o.req_id] += o.new_token_ids
            got[o.req_id] += o.logprobs or []
    assert len(got[a]) == len(toks[a]) == 5 and got[b] == []
    for t, lp in zip(toks[a], got[a]):
        assert lp["top"][0][0] == t and len(lp["top"]) == 2 and lp["logprob"] <= 0


def test_logprobs_of_reports_a_token_sampled_outside_the_top_and_with_no_alternatives():
    """What the completions route needs to always list the sampled token: its own logprob,
    exact, when hot sampling drew a token outside the top N, and for logprobs 0 (no top)."""
    logits = torch.tensor([[4.0, 3.0, 2.0, 0.0, -1.0]] * 2, dtype=torch.float64)
    specs = [SamplingSpec(1.0, 1.0, 0, 1, 0, 2), SamplingSpec(1.0, 1.0, 0, 1, 0, 0)]
    out = logprobs_of(logits, [4, 3], specs)  # as if sampled: neither is in the top 2
    ref = torch.log_softmax(logits[0], -1)
    assert abs(out[0]["logprob"] - float(ref[4])) < 1e-12 and [t for t, _ in out[0]["top"]] == [0, 1]
    assert abs(out[1]["logprob"] - float(ref[3])) < 1e-12 and out[1]["top"] == []
