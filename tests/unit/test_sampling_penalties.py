"""Penalties, logit_bias and min_tokens (issue 19): the sampler's one vectorised pass equals a
direct per-row computation of each definition, rows without them are untouched, and a seeded
request with penalties draws the same tokens whatever happens to it — alone or in a batch,
under forced retraction, with overlap scheduling, and when its state moves to another engine
mid-decode (the hand-off/migration path)."""
from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import HYBRID, assert_idle_clean, make_engine, make_prompts, run_requests, tiny_model
from hyrax.actors.engine.plan import SamplingSpec
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.sampler import process_logits, sample
from hyrax.actors.model.errors import HyraxInputError

V = 12
EOS = (11,)


def _spec(p: SamplingParams, history: list[int], draw: int) -> SamplingSpec:
    return SamplingSpec.of(p, seed=1, draw=draw, ids=history)


def _direct(row: torch.Tensor, p: SamplingParams, history: list[int], draw: int) -> torch.Tensor:
    """Each definition applied to one row with plain Python loops (the oracle)."""
    x = [float(v) for v in row]
    for t, b in p.logit_bias:
        x[t] += b
    if draw < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)):
            x[t] = -math.inf
    outputs = history[len(history) - draw:]
    for t in set(history):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(outputs):
        x[t] -= p.frequency_penalty * outputs.count(t) + p.presence_penalty
    return torch.tensor(x, dtype=torch.float64)


CASES = {
    "presence": SamplingParams(presence_penalty=1.5),
    "frequency": SamplingParams(frequency_penalty=0.7),
    "negative_frequency": SamplingParams(frequency_penalty=-1.0),
    "repetition": SamplingParams(repetition_penalty=1.8),
    "repetition_below_1": SamplingParams(repetition_penalty=0.5),
    "logit_bias": SamplingParams(logit_bias=((2, 5.0), (7, -100.0))),
    "min_tokens": SamplingParams(min_tokens=6, stop_token_ids=(3,)),
    "min_tokens_ignore_eos": SamplingParams(min_tokens=6, stop_token_ids=(3,), ignore_eos=True),
    "all": SamplingParams(presence_penalty=0.3, frequency_penalty=0.4, repetition_penalty=1.3,
                          logit_bias=((5, 2.0),), min_tokens=9, stop_token_ids=(4,)),
}
HISTORY = [1, 2, 3, 5, 5, 9, 2, 5, 0]  # 5 prompt tokens, then 4 outputs: 5, 9, 2, 5 ... and 0
DRAW = 4


@pytest.mark.parametrize("name", list(CASES))
def test_processing_matches_the_definition_row_by_row(name):
    p = CASES[name]
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, V, generator=g) * 3
    plain = SamplingParams(temperature=1.0)
    history = HISTORY[:-1]  # the last id drawn is the 4th output
    specs = [_spec(plain, history, DRAW), _spec(p, history, DRAW), _spec(p, HISTORY, DRAW + 1)]
    histories = [None, history, HISTORY]
    got = process_logits(logits, specs, histories, EOS)
    assert torch.equal(got[0], logits[0].double()), "a row without processing changed"
    torch.testing.assert_close(got[1], _direct(logits[1], p, history, DRAW), rtol=0, atol=1e-12)
    torch.testing.assert_close(got[2], _direct(logits[2], p, HISTORY, DRAW + 1), rtol=0, atol=1e-12)
    assert not torch.equal(got[1], logits[1].double()), "the processing had no effect: the test could not fail"


def test_each_penalty_moves_probability_the_way_its_definition_says():
    logits = torch.zeros(1, V)
    history = [1, 1, 2, 6, 6, 6]  # prompt [1, 1, 2]; outputs 6, 6, 6
    probs = {}
    for name, p in {"none": SamplingParams(), "presence": SamplingParams(presence_penalty=1.0),
                    "frequency": SamplingParams(frequency_penalty=1.0),
                    "repetition": SamplingParams(repetition_penalty=2.0)}.items():
        x = logits.clone()
        x[0, 1], x[0, 6], x[0, 2] = 1.0, 1.0, -1.0
        out = process_logits(x, [_spec(p, history, 3)], [history], EOS)
        probs[name] = torch.softmax(out[0], -1)
    base = probs["none"]
    assert probs["presence"][6] < base[6] and probs["presence"][1] > base[1] * 0.999  # prompt untouched
    assert probs["frequency"][6] < probs["presence"][6]  # three occurrences weigh three times
    rep = probs["repetition"]
    assert rep[1] < base[1] and rep[6] < base[6] and rep[2] < base[2]  # prompt and outputs, either sign


def test_min_tokens_masks_eos_and_stop_ids_only_until_reached():
    logits = torch.zeros(2, V)
    p = SamplingParams(min_tokens=2, stop_token_ids=(3,))
    out = process_logits(logits, [_spec(p, [1, 2], 1), _spec(p, [1, 2, 4], 2)], [[1, 2], [1, 2, 4]], EOS)
    assert out[0, 3] == -math.inf and out[0, EOS[0]] == -math.inf
    assert torch.isfinite(out[1]).all()


def test_greedy_sampling_uses_the_processed_logits():
    logits = torch.tensor([[5.0, 4.0, 0.0, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert sample(logits, [_spec(p, [3, 0], 1)], [[3, 0]]) == [1]
    assert sample(logits, [_spec(SamplingParams(), [3, 0], 1)]) == [0]


def test_a_request_without_these_fields_carries_no_tokens_in_the_plan():
    assert SamplingSpec.of(SamplingParams(temperature=0.7), 1, 0, list(range(100))).process is None
    assert list(SamplingSpec.of(SamplingParams(presence_penalty=0.1), 1, 0, [1, 2]).process.history) == [1, 2]


@pytest.mark.parametrize("bad", [dict(presence_penalty=3.0), dict(frequency_penalty=float("nan")),
                                 dict(repetition_penalty=0.0), dict(min_tokens=20, max_tokens=10),
                                 dict(logit_bias=((1, float("inf")),))])
def test_invalid_values_are_refused(bad):
    with pytest.raises(HyraxInputError):
        SamplingParams(**bad).validate()


def test_token_ids_are_checked_against_the_vocabulary():
    SamplingParams(logit_bias=((V - 1, 1.0),), stop_token_ids=(0,)).validate(V)
    for bad in (dict(logit_bias=((V, 1.0),)), dict(stop_token_ids=(V,)), dict(stop_token_ids=(-1,))):
        with pytest.raises(HyraxInputError):
            SamplingParams(**bad).validate(V)


# ---- through the engine ---------------------------------------------------------------------
PROMPTS = make_prompts(6, seed=31)


def _penalised(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=14, temperature=1.0, top_k=30, seed=seed, presence_penalty=0.8,
                          frequency_penalty=0.5, repetition_penalty=1.4, logit_bias=((7, 1.5), (11, -2.0)),
                          min_tokens=3, stop_token_ids=(13,))


PARAMS = [_penalised(500 + i) for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def uninterrupted():
    return run_requests(make_engine(tiny_model(HYBRID)), PROMPTS, PARAMS)


def test_penalties_change_the_seeded_output(uninterrupted):
    plain = [SamplingParams(max_tokens=14, temperature=1.0, top_k=30, seed=500 + i) for i in range(len(PROMPTS))]
    assert run_requests(make_engine(tiny_model(HYBRID)), PROMPTS, plain) != uninterrupted


def test_seeded_penalised_request_is_independent_of_its_batch(uninterrupted):
    alone = run_requests(make_engine(tiny_model(HYBRID)), PROMPTS[:1], PARAMS[:1])
    assert alone[0] == uninterrupted[0]


@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool"])
def test_penalised_run_under_forced_retraction_equals_the_uninterrupted_run(uninterrupted, mode):
    e = make_engine(tiny_model(HYBRID), forced_retraction_interval=3, retraction_backup=mode)
    assert run_requests(e, PROMPTS, PARAMS) == uninterrupted
    s = e.stats.summary()
    assert s["retractions"] >= 3, s


def test_penalised_run_with_overlap_scheduling_equals_the_plain_loop(uninterrupted):
    """Under overlap the plan's last history id is the in-flight token: the rank fills it in."""
    e = make_engine(tiny_model(HYBRID), overlap=True)
    plans = []
    def record(plan, _run=e.executor.submit):
        plans.append(plan)
        return _run(plan)
    e.executor.submit = record  # every step, synchronous or overlapped, is submitted
    ids = [e.add_request(p, sp) for p, sp in zip(PROMPTS, PARAMS)]
    while e.has_unfinished() or e.has_inflight():
        e.step()
    assert [e.finished_requests[i].output_ids for i in ids] == uninterrupted
    assert_idle_clean(e)
    in_flight = [x for p in plans for x in p.entries if x.sample and x.sample.process.history[-1] < 0]
    assert in_flight, "no plan referred to an in-flight token: the test did not exercise overlap"


def test_penalised_request_moved_mid_decode_continues_exactly(uninterrupted):
    """Export after a few tokens, import into another engine (the PD hand-off / migration path)."""
    src, dst = make_engine(tiny_model(HYBRID)), make_engine(tiny_model(HYBRID))
    rid = src.add_request(PROMPTS[0], PARAMS[0])
    while len(src.requests[rid].output_ids) < 5:
        src.step()
    src.sync()
    handoff = src.export_running(rid)
    dst.import_request(handoff)
    src.release_handoff(rid)
    while dst.has_unfinished():
        dst.step()
    assert dst.finished_requests[rid].output_ids == uninterrupted[0]
    assert_idle_clean(dst)
