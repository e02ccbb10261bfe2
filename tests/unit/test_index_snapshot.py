"""Request indices and their snapshots (hyrax/actors/engine/indices.py): a view sees a request's
indices through one snapshot while they do not change, and a new one after any change; the
scheduler's steady decode entries share the snapshot's split dicts and stay equal to what the
general path builds."""
from __future__ import annotations

import pytest

from hyrax.actors.engine.indices import IndexSnapshot, IndexTable
from hyrax.actors.engine.request import Request, SamplingParams
from hyrax.actors.engine.view import view_of

MUTATIONS = {
    "setitem": lambda t: t.__setitem__("kv", (7,)),
    "delitem": lambda t: t.__delitem__("kv"),
    "update": lambda t: t.update(kv=(8,)),
    "pop": lambda t: t.pop("kv"),
    "popitem": lambda t: t.popitem(),
    "setdefault": lambda t: t.setdefault("new", (1,)),
    "clear": lambda t: t.clear(),
    "ior": lambda t: t.__ior__({"kv": (9,)}),
}


@pytest.mark.parametrize("how", sorted(MUTATIONS))
def test_every_change_gives_a_new_snapshot_with_the_new_contents(how):
    t = IndexTable({"kv": (1, 2), "slot": (3,)})
    first = t.snapshot()
    assert t.snapshot() is first  # unchanged: the same object
    MUTATIONS[how](t)
    after = t.snapshot()
    assert after is not first and dict(after) == dict(t)
    assert dict(first) == {"kv": (1, 2), "slot": (3,)}  # a snapshot already handed out never changes


def test_a_view_follows_the_request_indices_and_reuses_the_snapshot_while_they_hold():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), seed=0)
    req.indices.update({"kv": (0,), "ssm": (5,)})
    a, b = view_of(req), view_of(req)
    assert a.indices is b.indices and type(a.indices) is IndexSnapshot
    req.indices["kv"] = (0, 4)  # a page added (as claim does)
    c = view_of(req)
    assert c.indices["kv"] == (0, 4) and a.indices["kv"] == (0,)


def test_a_plain_dict_assigned_to_a_request_is_still_viewed_as_tuples():
    req = Request("r", [1, 2, 3], SamplingParams(max_tokens=4), seed=0)
    req.indices = {"kv": [0, 1], "ssm": [5]}  # not an IndexTable: copied into a snapshot each time
    v = view_of(req)
    assert type(v.indices) is IndexSnapshot and v.indices == {"kv": (0, 1), "ssm": (5,)}


def test_split_is_remembered_per_name_tuple_and_refuses_a_missing_table():
    s = IndexSnapshot({"kv": (1, 2), "win": (3,), "ssm": (9,)})
    paged, slotted = ("kv", "win"), ("ssm",)
    got = s.split(paged, slotted)
    assert got == ({"kv": (1, 2), "win": (3,)}, {"ssm": 9})
    assert s.split(paged, slotted) is got
    assert s.split(("kv",), ("ssm",)) == ({"kv": (1, 2)}, {"ssm": 9})  # other names: computed anew
    assert IndexSnapshot({"ssm": (9,)}).split(paged, slotted) is None


def test_steady_decode_entries_from_snapshots_equal_those_from_plain_tables_and_follow_changes():
    """The scheduler's snapshot path (shared split dicts, inline sampling spec) plans what its
    path for views made by hand plans; a table changed between steps is planned as changed."""
    import torch

    from engine_helpers import tiny_config
    from hyrax.actors.engine.allocator import IndexAllocator
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.request import State
    from hyrax.actors.engine.scheduler import Scheduler
    from hyrax.actors.engine.view import build_view
    from hyrax.actors.model.state import derive_components

    ps = 4
    comps = derive_components(tiny_config("full_swa_mamba"), dtype=torch.float32)
    config = EngineConfig(page_size=ps, max_batch_tokens=16, prefill_chunk=8, max_running=4, prefix_cache=False)
    params = [SamplingParams(max_tokens=50), SamplingParams(max_tokens=50, temperature=0.7, top_k=5, logprobs=2),
              SamplingParams(max_tokens=50, presence_penalty=0.5)]

    def requests(table_type):
        out = []
        for i, p in enumerate(params):
            n = 9 + i  # positions 9..11: inside the third page
            tables = {c.name: tuple(range(10 * i, 10 * i + 3)) if c.paged else (i,) for c in comps}
            out.append(Request(f"r{i}", list(range(n - 2)), p, seed=i, output_ids=[5, 6], state=State.RUNNING,
                               num_computed=n - 1, indices=table_type(tables)))
        return out

    def plan(reqs):
        alloc = {c.name: IndexAllocator(c.name, 64) for c in comps}
        return Scheduler(comps, config).schedule(
            build_view(3, reqs, [], alloc, None, config.max_running, config.max_batch_tokens, True, 0.0)).plan.entries

    snap_reqs = requests(IndexTable)
    first = plan(snap_reqs)
    assert first == plan(requests(dict))
    assert plan(snap_reqs) == first  # planned again from the same snapshots: the same entries
    name = next(c.name for c in comps if c.paged)
    snap_reqs[0].indices[name] = (40, 41, 42)  # replaced between steps
    again = plan(snap_reqs)
    assert again[0].page_tables[name] == (40, 41, 42) and first[0].page_tables[name] == (0, 1, 2)
    assert again[1:] == first[1:]
