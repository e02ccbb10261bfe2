"""A step that runs out of device memory shrinks the batch instead of failing its requests
(issue 18): the engine lowers its batch cap, rebuilds the step's requests from their tokens
(the failed forward may have written part of their state) and runs them again in smaller
steps; only a request that runs out of memory alone, in the smallest step there is, ends with
`error`. The injected fault runs the whole step (every row written) before it raises, so an
engine that carried on from those rows would decode on twice-advanced recurrent state.

Recompute replays tokens through the prefill path, which is not bit-identical to decode: the
model runs in float64 so greedy tokens compare exactly (as in test_engine_retraction)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import BASE_CONFIG, HYBRID, assert_idle_clean, greedy, make_prompts, reference_outputs, tiny_model
from hyrax.actors.engine.batch_cap import BatchCap
from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from hyrax.actors.engine.executor import LocalExecutor, StepError, StepOutOfMemory
from hyrax.actors.engine.local import engine_for_model
from hyrax.actors.engine.plan import PlanEntry, StepPlan
from hyrax.actors.engine.stats import BatchCapStats
from hyrax.actors.model.errors import HyraxInputError

F64 = torch.float64


def _engine(overlap: bool, prefix_cache: bool = True, **faults):
    config = dataclasses.replace(EngineConfig(**BASE_CONFIG), faults=UnsafeFaults(**faults), allow_unsafe=True,
                                 overlap=overlap, prefix_cache=prefix_cache)
    return engine_for_model(tiny_model(HYBRID, F64), config)


def _run(e, prompts, max_tokens, limit=4000) -> tuple[list[str], dict]:
    """Run to the end, checking the invariants every step; (request ids, lowest cap seen)."""
    ids = [e.add_request(p, greedy(max_tokens)) for p in prompts]
    lowest = {"oom_above_tokens": e.cap.tokens, "oom_above_requests": e.cap.running}
    for _ in range(limit):
        if not e.has_unfinished() and not e.has_inflight():
            break
        e.step()
        e.check_invariants()
        lowest = {"oom_above_tokens": min(lowest["oom_above_tokens"], e.cap.tokens),
                  "oom_above_requests": min(lowest["oom_above_requests"], e.cap.running)}
    else:
        raise AssertionError("requests still unfinished")
    return ids, lowest


# big prefill steps run out of memory; or decode steps of more than 3 requests, mid-sequence:
# there a retry on the written rows would advance the recurrent state twice (the mutation
# check: keeping the rows instead of rebuilding changes 4 of 6 outputs, or trips the prefix
# cache's track bookkeeping)
FAULTS = [{"oom_above_tokens": 12}, {"oom_above_requests": 3}]


@pytest.mark.parametrize("prefix_cache", [True, False])
@pytest.mark.parametrize("fault", FAULTS, ids=lambda f: next(iter(f)))
@pytest.mark.parametrize("overlap", [False, True])
def test_out_of_memory_shrinks_the_batch_and_every_request_matches_the_reference(overlap, fault, prefix_cache):
    prompts = make_prompts(6, seed=3, lo=5, hi=30)
    want = reference_outputs(HYBRID, F64, prompts, 12)
    e = _engine(overlap, prefix_cache, **fault)
    e.cap.grow_after = 5  # grow back soon, so the run also sees the cap grow and shrink again
    rank = e.executor.rank
    ids, lowest = _run(e, prompts, 12)
    assert [e.finished_requests[i].output_ids for i in ids] == want
    assert {e.finished_requests[i].finish_reason for i in ids} == {"length"}
    s = e.stats.summary()
    cap = s["batch_cap"]
    # (with overlap, the step after a failed one may raise too: it is dropped with it)
    assert 1 <= cap["out_of_memory_steps"] <= rank.raised, (rank.raised, cap)
    assert cap["shrinks"] >= 1 and cap["rebuilt"] >= 1 and cap["failed"] == 0, cap
    assert cap["grows"] >= 1, cap
    assert all(lowest[k] <= n for k, n in fault.items()), lowest  # the cap went below what failed
    assert s["step_errors"] == 0 and s["recoveries"] == 0, s
    assert e.executor.rank is rank  # the same rank throughout: nothing was restarted
    assert_idle_clean(e)


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_out_of_memory_alone_in_the_smallest_step_ends_with_error_and_the_rest_finish(overlap):
    # deterministic chunks are 8 tokens: a prompt longer than 6 cannot run a step of <= 6 tokens
    short = make_prompts(5, seed=8, lo=3, hi=6)
    long_prompt = make_prompts(1, seed=9, lo=20, hi=20)[0]
    want = reference_outputs(HYBRID, F64, short, 10)
    e = _engine(overlap, oom_above_tokens=6)
    ids, _ = _run(e, [long_prompt, *short], 10)
    doomed, rest = ids[0], ids[1:]
    assert e.finished_requests[doomed].finish_reason == "error"
    assert [e.finished_requests[i].output_ids for i in rest] == want
    cap = e.stats.summary()["batch_cap"]
    assert cap["failed"] == 1 and cap["shrinks"] >= 1 and cap["rebuilt"] >= 1, cap
    assert e.stats.summary()["step_errors"] == 0
    assert_idle_clean(e)


def test_an_out_of_memory_on_the_rank_is_a_typed_step_error():
    class Raising:
        def execute(self, plan):
            raise torch.OutOfMemoryError("CUDA out of memory")

    class Other:
        def execute(self, plan):
            raise RuntimeError("out of memory")  # the message alone does not make it one

    plan = StepPlan(1, (), {})
    with pytest.raises(StepOutOfMemory):
        LocalExecutor(Raising()).collect(LocalExecutor(Raising()).submit(plan))
    with pytest.raises(StepError) as got:
        LocalExecutor(Other()).collect(LocalExecutor(Other()).submit(plan))
    assert not isinstance(got.value, StepOutOfMemory)


def _plan(n_entries: int, tokens_each: int) -> StepPlan:
    entries = tuple(PlanEntry(f"r{k}", (1,) * tokens_each, 0, {}, {}, None) for k in range(n_entries))
    return StepPlan(1, entries, {})


def test_batch_cap_halves_from_the_failed_step_and_grows_back_to_the_config():
    config = EngineConfig(max_running=64, max_batch_tokens=512, prefill_chunk=256)
    cap = BatchCap(config, BatchCapStats(), grow_after=3)
    cap.shrink(_plan(10, 1))  # 10 decodes: half of that step, not of the cap
    assert (cap.running, cap.tokens) == (5, 5)
    assert cap.config.max_batch_tokens == 5 and cap.config.prefill_chunk == 5  # a valid config
    assert not cap.smallest(_plan(1, 5)) and cap.smallest(_plan(1, 1))
    assert [cap.step_ok() for _ in range(3)] == [False, False, True]
    assert (cap.running, cap.tokens) == (10, 10)
    for _ in range(3 * 8):
        cap.step_ok()
    assert (cap.running, cap.tokens) == (64, 512) and not cap.lowered
    assert cap.stats.shrinks == 1 and cap.stats.grows == 7


def test_batch_cap_keeps_whole_deterministic_chunks():
    cap = BatchCap(EngineConfig(max_batch_tokens=32, prefill_chunk=8, deterministic=True), BatchCapStats())
    cap.shrink(_plan(1, 8))
    assert cap.tokens == 8 and cap.smallest(_plan(1, 8))


def test_negative_oom_fault_is_refused():
    with pytest.raises(HyraxInputError, match="oom_above_tokens"):
        UnsafeFaults(oom_above_tokens=-1)
