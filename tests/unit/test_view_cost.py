"""The scheduler's view of a running request costs the same whatever its length (issue 21).

A decode step used to rebuild every request's prompt + outputs as a tuple to make its view:
O(length) per request per step, O(length^2) over a generation. The view now reads the
request's own (append-only) token lists through `Tokens`. These tests count the tokens a
step's view building and planning read from a request's lists, at two lengths, and check
`Tokens` against the tuple it stands for.
"""
from __future__ import annotations

import random

import pytest
import torch

from engine_helpers import tiny_config
from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.plan import PlanEntry, SamplingSpec, StepPlan
from hyrax.actors.engine.request import Request, SamplingParams, State
from hyrax.actors.engine.scheduler import Scheduled, Scheduler
from hyrax.actors.engine.view import PLACEHOLDER, Tokens, build_view
from hyrax.actors.model.state import derive_components

PS = 4
COMPS = derive_components(tiny_config("full_swa_mamba"), dtype=torch.float32)
CONFIG = EngineConfig(page_size=PS, max_batch_tokens=16, prefill_chunk=8, max_running=4, prefix_cache=False)


class CountingList(list):
    """A list that counts the elements read from it by iteration or indexing."""

    reads = 0

    def __iter__(self):
        for x in super().__iter__():
            CountingList.reads += 1
            yield x

    def __getitem__(self, k):
        got = super().__getitem__(k)
        CountingList.reads += len(got) if isinstance(k, slice) else 1
        return got


def _decode_step_reads(prompt_len: int, outputs: int, in_flight: bool) -> tuple[int, PlanEntry]:
    """Tokens read from the request's lists to view it and plan its next decode token."""
    n = prompt_len + outputs
    pages = -(-(n + 1) // PS)
    req = Request("r", CountingList(range(prompt_len)), SamplingParams(max_tokens=10**9), seed=1,
                  output_ids=CountingList(range(outputs)), state=State.RUNNING,
                  num_computed=n if in_flight else n - 1,
                  indices={c.name: list(range(pages)) if c.paged else [0] for c in COMPS})
    flight = None
    if in_flight:  # the step in flight runs its last token and samples the next one
        flight = StepPlan(1, (PlanEntry("r", (n - 1,), n - 1, {}, {}, SamplingSpec(0.0, 1.0, 0, 1, outputs - 1)),), {})
    alloc = {c.name: IndexAllocator(c.name, 64) for c in COMPS}
    CountingList.reads = 0
    view = build_view(2, [req], [], alloc, flight, CONFIG.max_running, CONFIG.max_batch_tokens, True, 0.0)
    got = Scheduler(COMPS, CONFIG).schedule(view)
    reads = CountingList.reads
    assert isinstance(got, Scheduled) and len(got.plan.entries) == 1
    return reads, got.plan.entries[0]


@pytest.mark.parametrize("in_flight", [False, True])
def test_viewing_and_planning_a_decode_step_reads_a_constant_number_of_tokens(in_flight):
    short, e_short = _decode_step_reads(8, 20, in_flight)
    long_out, e_long = _decode_step_reads(8, 20_000, in_flight)
    long_prompt, _ = _decode_step_reads(20_000, 20, in_flight)
    # the plan is right: the last output (or, with a step in flight, its placeholder) at its position
    assert e_long.start == (8 + 20_000 if in_flight else 8 + 20_000 - 1)
    assert e_long.token_ids == ((PLACEHOLDER,) if in_flight else (19_999,))
    assert e_long.sample is not None and e_long.sample.draw == (20_001 if in_flight else 20_000)
    assert e_short.token_ids == ((PLACEHOLDER,) if in_flight else (19,))
    # O(1): the same few reads at 28 tokens and at 20,008 (rebuilding the tuple read every token)
    assert short == long_out == long_prompt <= 2


def test_tokens_behave_as_the_tuple_they_stand_for():
    rng = random.Random(1)
    for _ in range(500):
        prompt = [rng.randint(0, 9) for _ in range(rng.randint(0, 5))]
        outputs = [rng.randint(0, 9) for _ in range(rng.randint(0, 5))]
        n_out, extra = rng.randint(0, len(outputs)), rng.randint(0, 2)
        t = Tokens(prompt, outputs, n_out, extra)
        ref = tuple(prompt + outputs[:n_out] + [PLACEHOLDER] * extra)
        outputs.append(7)  # the request grows after the view was made: the view does not change
        assert len(t) == len(ref) and tuple(t) == ref and t == ref
        for a in [*range(-7, 8), None]:
            for b in [*range(-7, 8), None]:
                for stride in (None, 1, 2, -1):
                    assert t[a:b:stride] == ref[a:b:stride]
        assert [t[i] for i in range(-len(ref), len(ref))] == [ref[i] for i in range(-len(ref), len(ref))]
        if ref:
            assert t.last() == ref[-1:]
        with pytest.raises(IndexError):
            t[len(ref)]


def test_page_tables_are_shared_by_the_request_its_view_and_its_plan_not_copied_per_step():
    """A view copied every page table per request per step: O(length / page size) each. The
    engine keeps them as tuples, replaced when they change (a new page, a window's release), so
    the view and a decode entry hold the request's own tables."""
    from engine_helpers import HYBRID, greedy, make_engine, tiny_model

    e = make_engine(tiny_model(HYBRID))
    rids = [e.add_request(list(range(1, 1 + n)), greedy(30)) for n in (5, 11)]
    seen_release, shared_entries = False, 0
    while e.has_unfinished():
        e.step()
        for r in e.running:
            assert all(type(t) is tuple for t in r.indices.values()), r.indices
            seen_release |= any(p < 0 for p in r.indices["swa_kv"])
            sv = build_view(e.step_count, [r], [], e.alloc, None, 1, 4, False, 0.0)
            view = sv.running[0]
            assert all(view.indices[n] is t for n, t in r.indices.items())
            got = e.scheduler.schedule(sv)
            if isinstance(got, Scheduled) and got.plan.entries and not got.grants:  # took no page
                entry = got.plan.entries[0]
                assert all(entry.page_tables[n] is r.indices[n] for n in entry.page_tables)
                shared_entries += 1
    assert shared_entries > 10
    assert seen_release  # the window's early pages went back: a replaced table, still a tuple
    assert all(len(e.finished_requests[i].output_ids) == 30 for i in rids)
