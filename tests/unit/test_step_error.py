"""A step that raises on live ranks (an out-of-memory, a kernel refusing its input) is a
deterministic error of that step's requests, not a rank death (issue 18, finding 2): those
requests end with `error`, every other request finishes exactly as in a run without the
fault, nothing is rebuilt, and every pool returns to baseline. (Before, the loop treated it
as a dead rank: restart the ranks, recompute every request, three times, then fail them all.)"""
from __future__ import annotations

import dataclasses

from engine_helpers import BASE_CONFIG, HYBRID, assert_idle_clean, greedy, make_prompts, reference_outputs, tiny_model
from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from hyrax.actors.engine.local import engine_for_model, run_to_completion

import torch

LONG, SHORT = 30, 8  # prompt lengths; the fault fires when a request reaches 36 tokens of context


def _engine(overlap: bool):
    faults = UnsafeFaults(step_error_at_context=LONG + 6)
    config = dataclasses.replace(EngineConfig(**BASE_CONFIG), faults=faults, allow_unsafe=True, overlap=overlap,
                                 max_running=1)  # one request per step: the failing step is the long one's
    return engine_for_model(tiny_model(HYBRID), config)


def test_a_step_error_fails_only_its_requests_and_keeps_the_ranks():
    short = make_prompts(3, seed=5, lo=SHORT, hi=SHORT)
    long_prompt = make_prompts(1, seed=6, lo=LONG, hi=LONG)[0]
    want = reference_outputs(HYBRID, torch.float32, short, 10)
    for overlap in (False, True):
        e = _engine(overlap)
        ids = [e.add_request(p, greedy(10)) for p in short]
        run_to_completion(e)  # short requests never reach the faulty context length
        doomed = e.add_request(long_prompt, greedy(20))
        later = e.add_request(short[0], greedy(10))
        run_to_completion(e)
        assert [e.finished_requests[i].output_ids for i in ids] == want
        assert e.finished_requests[doomed].finish_reason == "error"
        assert len(e.finished_requests[doomed].output_ids) < 20
        s = e.stats.summary()
        assert s["step_errors"] >= 1 and s["recoveries"] == 0, s
        # the request queued behind it shared no step with it: it runs on the same ranks, exactly
        assert e.finished_requests[later].output_ids == want[0]
        assert_idle_clean(e)
