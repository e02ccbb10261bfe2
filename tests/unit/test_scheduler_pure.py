"""The scheduler as a pure function of an immutable view: no engine, no ranks, no allocators.

Each test builds a `SchedulerView` by hand and reads the `Scheduled` plan or the `NeedRoom`
answer. The view already includes the step in flight (a request's `computed` and its
placeholder token), which is what the engine used to pass as a hidden `ahead` field.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_helpers import tiny_config
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.scheduler import SHORTEST_FIRST_WINDOW_S, NeedRoom, Scheduled, Scheduler
from hyrax.actors.engine.view import PLACEHOLDER, FreePool, RequestView, SchedulerView
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.state import derive_components

PS = 4
COMPS = derive_components(tiny_config("full_swa_mamba"), dtype=torch.float32)  # full_kv, swa_kv, mamba_*
PAGED = [c.name for c in COMPS if c.paged]
SLOTS = [c.name for c in COMPS if not c.paged]
# the prefix cache's chunk cuts at track boundaries are tested on their own (test_prefix_engine.py)
CONFIG = EngineConfig(page_size=PS, max_batch_tokens=16, prefill_chunk=8, max_running=4, prefix_cache=False)
FCFS = dataclasses.replace(CONFIG, prefill_order="fcfs")


def req(rid: str, prompt: int, outputs: int = 0, computed: int | None = None, placeholder: bool = False,
        pages: int = 0, first_page: int = 100, slot: int | None = None, arrival: float = 0.0,
        max_tokens: int = 10) -> RequestView:
    """A request of `prompt` tokens with `outputs` generated; `pages` pages per paged component
    (numbered from `first_page`) and a slot when it is running."""
    ids = tuple(range(prompt + outputs)) + ((PLACEHOLDER,) if placeholder else ())
    indices = {n: tuple(range(first_page, first_page + pages)) for n in PAGED} if pages else {}
    if slot is not None:
        indices |= {n: (slot,) for n in SLOTS}
    return RequestView(rid, arrival, prompt, len(ids) - 1 if computed is None else computed, ids,
                       SamplingParams(max_tokens=max_tokens), seed=7, indices=indices)


def free(n_pages: int, n_slots: int = 8) -> dict[str, FreePool]:
    """Free pools handing out 0, 1, 2, ... in that order."""
    return {c.name: FreePool(n, tuple(range(n))) for c, n in
            ((c, n_pages if c.paged else n_slots) for c in COMPS)}


def view(running=(), waiting=(), n_pages: int = 64, **kw) -> SchedulerView:
    return SchedulerView(step=1, running=tuple(running), waiting=tuple(waiting), free=free(n_pages), **kw)


def schedule(v: SchedulerView, config: EngineConfig = CONFIG):
    return Scheduler(COMPS, config).schedule(v)


def test_same_view_gives_the_same_answer_and_is_not_changed():
    v = view(running=[req("a", 6, 2, pages=2, slot=3)], waiting=[req("b", 9, computed=0)])
    before = dataclasses.replace(v)
    first, second = schedule(v), schedule(v)
    assert isinstance(first, Scheduled) and first == second
    assert v == before


def test_decode_goes_first_then_prefill_chunks_then_admissions_within_the_token_budget():
    v = view(running=[req("prefilling", 20, computed=8, pages=2, slot=0, arrival=0.0),
                      req("decoding", 6, 3, pages=3, slot=1, arrival=1.0)],
             waiting=[req("new1", 9, computed=0, arrival=2.0), req("new2", 9, computed=0, arrival=3.0)])
    got = schedule(v)
    assert isinstance(got, Scheduled)
    order = [(e.req_id, len(e.token_ids)) for e in got.plan.entries]
    # budget 16: 1 decode token, an 8-token chunk (deterministic off: min(pending, chunk, budget)),
    # then 7 tokens of the first admission; the second does not get in
    assert order == [("decoding", 1), ("prefilling", 8), ("new1", 7)]
    assert got.admitted == ("new1",)
    assert got.plan.num_tokens == CONFIG.max_batch_tokens


def test_units_are_taken_from_the_free_lists_in_order_and_recorded_as_grants():
    v = view(waiting=[req("a", 6, computed=0), req("b", 3, computed=0)])
    got = schedule(v, FCFS)  # queue order (the default order would admit the shorter b first)
    a, b = got.plan.entries
    # a: positions 0..5 -> pages 0, 1 of each paged component; b: positions 0..2 -> page 2
    for name in PAGED:
        assert a.page_tables[name] == (0, 1) and b.page_tables[name] == (2,)
        assert got.grants["a"][name] == (0, 1) and got.grants["b"][name] == (2,)
    for name in SLOTS:
        assert (a.slots[name], b.slots[name]) == (0, 1)
        assert got.plan.zero_slots[name] == (0, 1)  # fresh slots are zeroed before the forward


def test_a_request_in_the_step_in_flight_is_planned_from_where_that_step_leaves_it():
    # 5 prompt tokens + 1 output committed; the step in flight computes token 6 and samples a 7th
    r = req("a", 5, 1, computed=6, placeholder=True, pages=2, slot=0)
    got = schedule(view(running=[r], in_flight=frozenset({"a"})))
    (e,) = got.plan.entries
    assert e.start == 6 and e.token_ids == (PLACEHOLDER,)
    assert e.sample.draw == 2  # the third output
    assert not got.grants.get("a")  # position 6 is on page 1, which it holds


def test_no_room_without_a_step_in_flight_names_the_fewest_victims_in_victim_order():
    # "grow" needs a new page (position 8 starts page 2) and nothing is free
    grow = req("grow", 8, 0, computed=8, pages=2, first_page=10, slot=0, arrival=0.0)
    old = req("old", 4, 5, pages=3, first_page=20, slot=1, arrival=1.0)  # more outputs: picked last
    young = req("young", 4, 1, pages=2, first_page=30, slot=2, arrival=2.0)
    grow = grow._replace(ids=grow.ids + (1,))  # its first output: one token to decode
    got = schedule(view(running=[grow, old, young], n_pages=0))
    assert got == NeedRoom(victims=("young",), short={"full_kv": 1, "swa_kv": 1})


def test_with_a_step_in_flight_no_victim_is_named_and_the_engine_is_told_to_wait_for_it():
    grow = req("grow", 8, 1, computed=8, pages=2, slot=0)
    other = req("other", 4, 1, pages=2, first_page=30, slot=1, arrival=1.0)
    got = schedule(view(running=[grow, other], n_pages=0, in_flight=frozenset({"grow"})))
    assert isinstance(got, Scheduled) and got.pressure
    assert [e.req_id for e in got.plan.entries] == ["other"]


def test_a_request_alone_that_can_never_grow_is_given_up():
    got = schedule(view(running=[req("alone", 8, 1, computed=8, pages=2, slot=0)], n_pages=0))
    assert got == NeedRoom(hopeless=("alone",), short={"full_kv": 1, "swa_kv": 1})


def test_admission_stops_at_max_running_while_retracted_requests_wait_and_under_the_reserve():
    waiting = [req(f"w{k}", 2, computed=0, arrival=k) for k in range(6)]
    assert schedule(view(waiting=waiting)).admitted == ("w0", "w1", "w2", "w3")  # max_running 4
    assert schedule(view(waiting=waiting, admit_new=False)).admitted == ()
    running = [req("r", 4, 1, pages=2, slot=0, max_tokens=400)]  # 399 tokens still to grow: ~100 pages
    assert schedule(view(running=running, waiting=waiting, reserve_ratio=1.0)).admitted == ()
    assert schedule(view(running=running, waiting=waiting, reserve_ratio=0.0)).admitted == ("w0", "w1", "w2")


def test_a_prefill_replica_never_decodes():
    cfg = dataclasses.replace(CONFIG, role="prefill")
    got = schedule(view(running=[req("done", 5, 1, pages=2, slot=0)]), cfg)
    assert got.plan.entries == ()


def test_deterministic_chunks_end_on_multiples_of_the_chunk_size():
    cfg = dataclasses.replace(CONFIG, deterministic=True)
    got = schedule(view(running=[req("a", 20, computed=3, pages=1, slot=0)]), cfg)
    (e,) = got.plan.entries
    assert (e.start, e.end) == (3, 8)


# ---- prefill order -------------------------------------------------------------------------
def _order(got) -> list[tuple[str, int]]:
    return [(e.req_id, len(e.token_ids)) for e in got.plan.entries]


def test_prompts_arriving_together_prefill_shortest_first():
    """A burst (arrivals within the window): the shortest prompts are admitted first, so more
    of them finish their prefill, and get a first token, in this step; the longest gets what
    budget is left. In arrival order the longest took the first chunk."""
    burst = [req("long", 12, computed=0, arrival=0.0), req("tiny", 3, computed=0, arrival=0.01),
             req("mid", 6, computed=0, arrival=0.02)]
    got = schedule(view(waiting=burst))
    assert _order(got) == [("tiny", 3), ("mid", 6), ("long", 7)]
    assert got.admitted == ("tiny", "mid", "long")
    fcfs = schedule(view(waiting=burst), FCFS)
    assert _order(fcfs) == [("long", 8), ("tiny", 3), ("mid", 5)]


def test_a_prompt_is_never_passed_by_one_that_arrived_after_the_window():
    late = SHORTEST_FIRST_WINDOW_S + 0.01
    got = schedule(view(waiting=[req("old", 12, computed=0, arrival=0.0), req("new", 3, computed=0, arrival=late)]))
    assert _order(got) == [("old", 8), ("new", 3)]


def test_running_prefills_and_admissions_of_one_burst_go_shortest_remaining_first():
    """A burst reaches the engine over several steps: "a" and "b" were admitted a step before
    "w" arrived (within the window). The shortest remaining goes first, admission or not; in
    arrival order (fcfs) every running chunk goes before any admission."""
    running = [req("a", 20, computed=4, pages=1, slot=1, arrival=0.0),  # 16 to go
               req("b", 10, computed=4, pages=1, first_page=110, slot=2, arrival=0.1)]  # 6 to go
    got = schedule(view(running=running, waiting=[req("w", 2, computed=0, arrival=0.2)]))
    assert _order(got) == [("w", 2), ("b", 6), ("a", 8)]
    assert got.admitted == ("w",)
    assert _order(schedule(view(running=running, waiting=[req("w", 2, computed=0, arrival=0.2)]), FCFS)) == \
        [("a", 8), ("b", 6), ("w", 2)]


def test_running_prefills_go_before_an_admission_after_the_window():
    running = [req("a", 20, computed=4, pages=1, slot=1, arrival=0.0)]
    late = SHORTEST_FIRST_WINDOW_S + 0.01
    got = schedule(view(running=running, waiting=[req("w", 2, computed=0, arrival=late)]))
    assert _order(got) == [("a", 8), ("w", 2)]


def test_an_admission_before_a_running_chunk_leaves_that_chunk_its_pages():
    """Free pages for the running chunks only: the short prompt first in line is not admitted
    (it would take a page they need and force a retraction); they run, nothing is retracted."""
    running = [req("a", 20, computed=4, pages=1, slot=1, arrival=0.0),  # positions 4..11: pages 1, 2
               req("b", 10, computed=4, pages=1, first_page=110, slot=2, arrival=0.1)]  # 4..9: pages 1, 2
    w = req("w", 2, computed=0, arrival=0.2)  # one page
    tight = schedule(view(running=running, waiting=[w], n_pages=4))
    assert isinstance(tight, Scheduled)
    assert _order(tight) == [("b", 6), ("a", 8)] and tight.admitted == ()
    roomy = schedule(view(running=running, waiting=[w], n_pages=5))
    assert _order(roomy) == [("w", 2), ("b", 6), ("a", 8)] and roomy.admitted == ("w",)


def test_prefill_order_values_are_checked():
    with pytest.raises(HyraxInputError, match="prefill-order must be one of shortest, fcfs, got 'lifo'"):
        dataclasses.replace(CONFIG, prefill_order="lifo")


def test_a_hit_taking_more_units_than_the_view_lists_asks_for_a_longer_list():
    """A prefix-cache hit at 16 holds its full-attention pages; besides its chunk's pages (16..23:
    pages 4, 5) it takes the page holding its window's live rows (12..15: page 3), which the hit's
    copies fill. The view lists 2 free units per pool (of 64 free): the scheduler asks for 3
    instead of taking past the list (it raised), and plans the step from a view listing 3."""
    hit = req("hit", 24, computed=16)._replace(indices={"full_kv": (100, 101, 102, 103)})

    def listing(n: int) -> SchedulerView:
        return SchedulerView(step=1, running=(), waiting=(hit,),
                             free={c.name: FreePool(64, tuple(range(n))) for c in COMPS})

    assert schedule(listing(2)) == NeedRoom(listed=3)
    got = schedule(listing(3))
    assert isinstance(got, Scheduled) and got.admitted == ("hit",)
    assert got.grants["hit"]["swa_kv"] == (0, 1, 2) and got.grants["hit"]["full_kv"] == (0, 1)
    assert got.plan.entries[0].page_tables["swa_kv"] == (-1, -1, -1, 0, 1, 2)
