"""min_p (as vLLM): after temperature, a token less likely than min_p times the most likely one
is never drawn; applied before top-k and top-p, after penalties and a grammar's mask. The
sampler's vectorised pass equals the definition row by row, rows without it are untouched, and
a seeded min_p request draws the same tokens whatever happens to it. The API takes it in [0, 1]."""
from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import HYBRID, make_engine, make_prompts, run_requests, tiny_model
from gateway_fakes import Replica, gateway
from hyrax.actors.engine.plan import SamplingSpec
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.sampler import sample, uniform
from hyrax.actors.model.errors import HyraxInputError

V = 40


def _direct(row: torch.Tensor, p: SamplingParams, seed: int, draw: int) -> int:
    """The definition with plain Python: temperature, then min_p on probabilities, top-k, top-p,
    and the draw by inverting the CDF (in token-id order) at the request's uniform number."""
    x = [float(v) / p.temperature for v in row]
    probs = [math.exp(v - max(x)) for v in x]
    keep = [q >= p.min_p * max(probs) for q in probs]
    if p.top_k:
        kth = sorted((v for v, k in zip(x, keep) if k), reverse=True)[min(p.top_k, sum(keep)) - 1]
        keep = [k and v >= kth for v, k in zip(x, keep)]
    w = [math.exp(v - max(x)) if k else 0.0 for v, k in zip(x, keep)]
    u, acc = uniform(seed, draw) * sum(w), 0.0
    for t, q in enumerate(w):
        acc += q
        if acc > u:
            return t
    return max(t for t, q in enumerate(w) if q > 0)


@pytest.mark.parametrize("kw", [dict(min_p=0.05), dict(min_p=0.3, temperature=0.5), dict(min_p=0.2, temperature=2.0),
                                dict(min_p=0.1, top_k=4), dict(min_p=1.0)])
def test_min_p_draws_what_the_definition_draws_row_by_row(kw):
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(6, V, generator=g) * 2.5
    p = SamplingParams(**{"temperature": 1.0, **kw})
    plain = SamplingParams(temperature=1.0)
    differs = 0
    for draw in range(40):
        # rows 0, 2, 4 with min_p, the others without, in one batch
        specs = [SamplingSpec.of(p if k % 2 == 0 else plain, 100 + k, draw, [1, 2]) for k in range(6)]
        got = sample(logits, specs, [[1, 2]] * 6)
        for k in range(6):
            want = _direct(logits[k], p if k % 2 == 0 else plain, 100 + k, draw)
            assert got[k] == want, (k, draw)
            differs += k % 2 == 0 and want != _direct(logits[k], plain, 100 + k, draw)
    assert differs, "min_p changed no draw: the test could not fail"


def test_min_p_is_taken_after_a_grammar_mask_and_greedy_rows_keep_their_token():
    logits = torch.tensor([[9.0, 1.0, 0.9, 0.0]])
    allowed = torch.tensor([[False, True, True, True]])
    p = SamplingParams(temperature=1.0, min_p=0.5)
    # among the allowed tokens 1 and 2 are within half the top one's probability, 3 is not
    seen = {sample(logits, [SamplingSpec.of(p, 7, d, [0])], [[0]], allowed=allowed)[0] for d in range(60)}
    assert seen == {1, 2}
    greedy = SamplingParams(temperature=0.0, min_p=0.9)
    assert sample(logits, [SamplingSpec.of(greedy, 7, 0, [0])], [[0]]) == [0]


@pytest.mark.parametrize("bad", [-0.1, 1.5, float("nan")])
def test_min_p_outside_0_1_is_refused(bad):
    with pytest.raises(HyraxInputError):
        SamplingParams(min_p=bad).validate()


# ---- through the engine -------------------------------------------------------------------
PROMPTS = make_prompts(5, seed=41)
PARAMS = [SamplingParams(max_tokens=12, temperature=1.5, seed=700 + i, min_p=0.15, ignore_eos=True)
          for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def uninterrupted():
    return run_requests(make_engine(tiny_model(HYBRID)), PROMPTS, PARAMS)


def test_min_p_changes_the_seeded_output(uninterrupted):
    plain = [SamplingParams(max_tokens=12, temperature=1.5, seed=700 + i, ignore_eos=True) for i in range(len(PROMPTS))]
    assert run_requests(make_engine(tiny_model(HYBRID)), PROMPTS, plain) != uninterrupted


@pytest.mark.parametrize("cfg", [dict(forced_retraction_interval=3, retraction_backup="recompute"),
                                 dict(forced_retraction_interval=3, retraction_backup="host_pool"),
                                 dict(overlap=True), dict(prefill_chunk=4)])
def test_a_seeded_min_p_run_equals_the_uninterrupted_run(uninterrupted, cfg):
    assert run_requests(make_engine(tiny_model(HYBRID), **cfg), PROMPTS, PARAMS) == uninterrupted
    assert run_requests(make_engine(tiny_model(HYBRID)), PROMPTS[:1], PARAMS[:1])[0] == uninterrupted[0]


# ---- the API --------------------------------------------------------------------------------
class Recording(Replica):
    def __init__(self):
        self.params = []

    def generate(self, request_id, prompt_ids, params):
        self.params.append(params)

        async def stream():
            yield {"token_ids": [65], "finished": True, "finish_reason": "length"}
        return stream()


@pytest.mark.parametrize("path,body", [("/v1/completions", {"prompt": "hi"}),
                                       ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})])
def test_the_api_passes_min_p_on_and_refuses_it_outside_0_1(path, body):
    r = Recording()
    http = gateway(r)
    assert http.post(path, json={"model": "m", **body, "min_p": 0.25}).status_code == 200
    assert http.post(path, json={"model": "m", **body}).status_code == 200
    assert [p["min_p"] for p in r.params] == [0.25, 0.0]
    bad = http.post(path, json={"model": "m", **body, "min_p": 1.5})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_p"
