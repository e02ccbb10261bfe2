"""Request lifecycle around retraction: abort in every state releases everything, held
requests stay put until resumed, bad input is refused without touching the engine."""
from __future__ import annotations

import math

import pytest
import torch

from engine_helpers import (
    HYBRID, HYBRID_COMPONENTS, VOCAB, assert_idle_clean, greedy, make_engine, make_prompts,
    reference_outputs, run_requests, tiny_model,
)
from hyrax.actors.engine.local import run_to_completion
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.request import SamplingParams, State
from hyrax.actors.model.errors import HyraxInputError

MODES = ("cpu_tensor", "host_pool", "recompute")


def _dtype(mode: str) -> torch.dtype:
    return torch.float64 if mode == "recompute" else torch.float32


def _host_used(e) -> dict[str, int]:
    return {n: a.num_used for n, a in e.host_alloc.items()}


def _device_used(e) -> dict[str, int]:
    return {n: a.num_used for n, a in e.alloc.items()}


def _finish_others(e, ids, ref) -> None:
    run_to_completion(e)
    assert_idle_clean(e)
    for i, r in zip(ids, ref):
        if r is not None:
            assert e.finished_requests[i].output_ids == r


@pytest.mark.parametrize("mode", MODES)
def test_abort_while_retracted_releases_the_backup(mode):
    dtype = _dtype(mode)
    prompts = make_prompts(3, seed=7)
    ref = reference_outputs(HYBRID, dtype, prompts)
    e = make_engine(tiny_model(HYBRID, dtype), retraction_backup=mode)
    ids = [e.add_request(p, greedy()) for p in prompts]
    for _ in range(4):
        e.step()
    victim = e.requests[ids[0]]
    assert victim.state == State.RUNNING and victim.output_ids
    assert e.retract([ids[0]], hold=True) == {ids[0]: mode}
    assert victim.state == State.RETRACTED and victim.indices == {}
    if mode == "cpu_tensor":
        assert e.executor.num_backups() == {0: 1}
        assert set(_host_used(e).values()) == {0}
    elif mode == "host_pool":
        assert all(_host_used(e)[c] > 0 for c in HYBRID_COMPONENTS), _host_used(e)
    else:
        assert e.executor.num_backups() == {0: 0} and victim.backup is None
    if mode != "host_pool":  # see test_check_invariants_holds_while_a_request_is_retracted_to_the_host_pool
        e.check_invariants()

    assert e.abort(ids[0]) is True
    assert e.executor.num_backups() == {0: 0}
    assert set(_host_used(e).values()) == {0}
    e.check_invariants()
    assert e.finished_requests[ids[0]].finish_reason == "abort"
    assert ids[0] not in e.requests and victim not in e.retracted
    assert e.abort(ids[0]) is False  # already gone
    _finish_others(e, ids, [None] + ref[1:])
    assert e.stats.summary()["finished"] == {"abort": 1, "length": 2}


def test_abort_in_every_state_leaves_the_pools_clean():
    prompts = make_prompts(4, seed=8, lo=12, hi=30)
    ref = reference_outputs(HYBRID, torch.float32, prompts)
    # arrival order, so that the first request is mid-prompt and the last still waits
    e = make_engine(tiny_model(HYBRID), max_batch_tokens=16, prefill_chunk=8, prefill_order="fcfs")
    ids = [e.add_request(p, greedy()) for p in prompts]
    e.step()
    states = {i: e.requests[i].state for i in ids}
    assert states[ids[0]] == State.RUNNING and e.requests[ids[0]].in_prefill  # mid-prompt
    assert states[ids[3]] == State.WAITING
    used_before = _device_used(e)
    assert e.abort(ids[0]) and e.abort(ids[3])
    e.check_invariants()
    assert all(_device_used(e)[c] <= used_before[c] for c in used_before)
    assert not any(a.owned_by(ids[0]) for a in e.alloc.values())
    assert set(e.requests) == {ids[1], ids[2]}
    assert all(r.id != ids[3] for r in e.waiting)
    _finish_others(e, ids, [None, ref[1], ref[2], None])


@pytest.mark.parametrize("mode", MODES)
def test_held_request_is_not_resumed_until_resume_then_matches_uninterrupted_run(mode):
    dtype = _dtype(mode)
    prompts = make_prompts(4, seed=9)
    ref = reference_outputs(HYBRID, dtype, prompts)
    e = make_engine(tiny_model(HYBRID, dtype), retraction_backup=mode)
    ids = [e.add_request(p, greedy()) for p in prompts]
    for _ in range(3):
        e.step()
    held = e.requests[ids[1]]
    assert e.retract([ids[1]], hold=True) == {ids[1]: mode}
    n_out = len(held.output_ids)
    others_before = {i: len(e.requests[i].output_ids) for i in (ids[0], ids[2], ids[3])}
    for _ in range(4):
        e.step()
        assert held.state == State.RETRACTED and held.hold and held in e.retracted
        assert len(held.output_ids) == n_out
    # a held request does not block the others
    assert all(len(e.requests[i].output_ids) > n for i, n in others_before.items())
    assert e.resume([ids[1]]) == {ids[1]: "recompute" if mode == "recompute" else "verified"}
    assert not held.hold
    _finish_others(e, ids, ref)
    s = e.stats.summary()
    assert s["retractions_by"] == {f"admin/{mode}": 1} and s["restore_fallbacks"] == 0, s


def test_held_request_alone_waits_for_resume_without_spinning():
    prompt = make_prompts(1, seed=10)[0]
    ref = reference_outputs(HYBRID, torch.float32, [prompt])[0]
    e = make_engine(tiny_model(HYBRID))
    rid = e.add_request(prompt, greedy())
    for _ in range(3):
        e.step()
    e.retract([rid], hold=True)
    for _ in range(5):
        assert e.step() == []
        e.check_invariants()
    assert e.has_unfinished() and e.requests[rid].state == State.RETRACTED
    assert e.resume([rid]) == {rid: "verified"}
    run_to_completion(e)
    assert_idle_clean(e)
    assert e.finished_requests[rid].output_ids == ref


def test_retract_and_resume_report_errors_for_requests_in_the_wrong_state():
    e = make_engine(tiny_model(HYBRID), max_batch_tokens=8, prefill_chunk=8, prefill_order="fcfs")
    a = e.add_request(make_prompts(1, seed=11, lo=20, hi=20)[0], greedy())
    b = e.add_request([1, 2, 3], greedy())
    e.step()  # a is prefilling, b waits for budget
    assert e.requests[b].state == State.WAITING
    out = e.retract(["nope", b])
    assert out == {"nope": Outcome.UNKNOWN, b: Outcome.NOT_RUNNING} and not any(v.ok for v in out.values())
    assert e.resume([a, "nope"]) == {a: Outcome.NOT_RETRACTED, "nope": Outcome.UNKNOWN}
    with pytest.raises(HyraxInputError):
        e.retract([a], mode="disk")
    assert e.requests[a].state == State.RUNNING
    with pytest.raises(HyraxInputError):
        e.set_forced_retraction(-1)
    run_to_completion(e)
    assert_idle_clean(e)


def test_check_invariants_holds_while_a_request_is_retracted_to_the_host_pool():
    e = make_engine(tiny_model("mamba"), retraction_backup="host_pool")
    a = e.add_request([1, 2, 3], greedy(8))
    e.add_request([4, 5], greedy(8))
    e.step()
    e.step()
    assert e.retract([a]) == {a: "host_pool"}
    e.check_invariants()


# ---- bad input -----------------------------------------------------------------------------

BAD_PARAMS = [
    dict(max_tokens=0), dict(max_tokens=-1), dict(max_tokens=2.5),
    dict(temperature=-0.1), dict(temperature=math.nan), dict(temperature=math.inf),
    dict(top_p=0.0), dict(top_p=-0.5), dict(top_p=1.5), dict(top_k=-1), dict(stop=("",)),
]
BAD_PROMPTS = {
    "empty": [], "negative id": [1, -1, 2], "id == vocab": [1, VOCAB], "id > vocab": [VOCAB + 7],
    "float id": [1, 2.0], "longer than the context": [1] * 512,
}


def _assert_untouched(e) -> None:
    assert not e.requests and not e.waiting and not e.running and not e.retracted
    assert e.stats.prompt_tokens == 0
    assert_idle_clean(e)


@pytest.mark.parametrize("kw", BAD_PARAMS, ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()))
def test_bad_sampling_params_are_refused_and_change_nothing(kw):
    e = make_engine(tiny_model(HYBRID))
    with pytest.raises(HyraxInputError):
        e.add_request([1, 2, 3], SamplingParams(**kw))
    _assert_untouched(e)


@pytest.mark.parametrize("name", list(BAD_PROMPTS))
def test_bad_prompts_are_refused_and_change_nothing(name):
    e = make_engine(tiny_model(HYBRID))
    with pytest.raises(HyraxInputError):
        e.add_request(BAD_PROMPTS[name], greedy())
    _assert_untouched(e)


def test_prompt_that_can_never_fit_the_pools_is_refused_and_the_engine_still_works():
    e = make_engine(tiny_model(HYBRID), kv_capacity_tokens=32)
    with pytest.raises(HyraxInputError, match="never fit"):
        e.add_request([3] * 40, greedy())
    _assert_untouched(e)
    # a request that fits still runs normally afterwards
    prompt = make_prompts(1, seed=12, lo=20, hi=20)[0]
    assert run_requests(e, [prompt], greedy(8)) == reference_outputs(HYBRID, torch.float32, [prompt], 8)


def test_bad_request_beside_running_ones_leaves_them_untouched():
    prompts = make_prompts(2, seed=13)
    ref = reference_outputs(HYBRID, torch.float32, prompts)
    e = make_engine(tiny_model(HYBRID))
    ids = [e.add_request(p, greedy()) for p in prompts]
    e.step()
    snapshot = ({i: (e.requests[i].state, list(e.requests[i].output_ids)) for i in ids}, _device_used(e),
                e.stats.prompt_tokens)
    for bad in ([], [VOCAB]):
        with pytest.raises(HyraxInputError):
            e.add_request(bad, greedy())
    with pytest.raises(HyraxInputError):
        e.add_request([1, 2], SamplingParams(top_p=0.0))
    with pytest.raises(HyraxInputError, match="already in use"):
        e.add_request([1, 2], greedy(), request_id=ids[0])
    assert ({i: (e.requests[i].state, list(e.requests[i].output_ids)) for i in ids}, _device_used(e),
            e.stats.prompt_tokens) == snapshot
    assert set(e.requests) == set(ids)
    _finish_others(e, ids, ref)
