"""State components derived from the config, their TP shards and pools, and the index allocator."""
from __future__ import annotations

import random

import pytest
import torch

from hyrax.actors.engine.allocator import AllocationError, IndexAllocator
from hyrax.actors.engine.pools import allocate_device_pools, pool_sizes
from hyrax.actors.model.sharding import TP
from hyrax.actors.model.state import derive_components
from tiny_models import tiny_config

# tiny_config: 4 q heads, 2 kv heads, head_dim 8; Mamba 4 heads x 8, state 8, 2 groups, d_conv 4
CONV_DIM = 4 * 8 + 2 * 2 * 8
EXPECTED = {
    "full": [("full_kv", "token", (0, 1))],
    "swa": [("swa_kv", "window", (0, 1))],
    "mamba": [("mamba_conv", "slot", (0, 1)), ("mamba_ssm", "slot", (0, 1))],
    "swa_mamba": [("swa_kv", "window", (0, 3)), ("mamba_conv", "slot", (1, 2)), ("mamba_ssm", "slot", (1, 2))],
    "full_swa_mamba": [("full_kv", "token", (0,)), ("swa_kv", "window", (2,)),
                       ("mamba_conv", "slot", (1, 3)), ("mamba_ssm", "slot", (1, 3))],
}
UNSHARDED_UNIT = {"full_kv": (2, 2, 8), "swa_kv": (2, 2, 8), "mamba_conv": (CONV_DIM, 3), "mamba_ssm": (4, 8, 8)}


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_each_layout_declares_exactly_its_components(layout):
    comps = derive_components(tiny_config(layout))
    assert [(c.name, c.kind, c.layers) for c in comps] == EXPECTED[layout]
    for c in comps:
        assert c.unit_shape == UNSHARDED_UNIT[c.name]
        assert c.window == (5 if c.kind == "window" else None)


@pytest.mark.parametrize("layout", list(EXPECTED))
def test_the_table_is_the_layer_modules_declarations_over_their_own_layers(layout):
    """Each layer module declares the components its layers keep; the table is their join, and
    a declared component covers exactly the layers of its module's layer type(s)."""
    from hyrax.actors.model import attention, gated_deltanet, mamba2

    cfg = tiny_config(layout)
    owners = {attention: ("full_attention", "sliding_attention"), mamba2: ("mamba2",),
              gated_deltanet: ("gated_deltanet",)}
    joined = []
    for module, ltypes in owners.items():
        declared = module.state_components(cfg, TP(), torch.float32)
        for c in declared:
            assert set(c.layers) <= {i for i, t in enumerate(cfg.layer_types) if t in ltypes}, (module, c.name)
        joined += declared
    assert tuple(joined) == derive_components(cfg)
    names = {c.name for c in joined}
    assert (mamba2.CONV in names) == (mamba2.SSM in names) == ("mamba2" in cfg.layer_types)


@pytest.mark.parametrize("model_dtype,ssm_dtype", [
    (torch.bfloat16, torch.float32), (torch.float32, torch.float32), (torch.float64, torch.float64)])
def test_recurrent_state_is_kept_in_at_least_float32(model_dtype, ssm_dtype):
    dtypes = {c.name: c.dtype for c in derive_components(tiny_config("full_swa_mamba"), dtype=model_dtype)}
    assert dtypes == {"full_kv": model_dtype, "swa_kv": model_dtype, "mamba_conv": model_dtype, "mamba_ssm": ssm_dtype}


@pytest.mark.parametrize("tp_size,local_unit", [
    (2, {"full_kv": (2, 1, 8), "mamba_conv": (16 + 8 + 8, 3), "mamba_ssm": (2, 8, 8)}),
    # 2 kv heads and 2 groups for 4 ranks: one kv head and one group (B, C) per rank, replicated
    (4, {"full_kv": (2, 1, 8), "mamba_conv": (8 + 8 + 8, 3), "mamba_ssm": (1, 8, 8)}),
], ids=["tp2", "tp4"])
def test_tp_shards_have_local_unit_shapes_and_together_cover_every_global_index(tp_size, local_unit):
    cfg = tiny_config("full_swa_mamba")
    shards = [derive_components(cfg, TP(r, tp_size)) for r in range(tp_size)]
    for rank_comps in shards:
        for c in rank_comps:
            assert c.unit_shape == local_unit.get(c.name, local_unit["full_kv"])
            assert c.global_unit_shape() == UNSHARDED_UNIT[c.name]
            assert len(c.shard_index) == c.unit_shape[c.shard_dim]
    for i, name in enumerate(["full_kv", "swa_kv", "mamba_conv", "mamba_ssm"]):
        held = [set(rank_comps[i].shard_index) for rank_comps in shards]
        assert set().union(*held) == set(range(UNSHARDED_UNIT[name][shards[0][i].shard_dim]))
    # split (not replicated) components give each rank disjoint indices
    ssm = [set(s[3].shard_index) for s in shards]
    assert sum(map(len, ssm)) == 4
    assert [s[0].shard_index for s in shards] == [(r * 2 // tp_size,) for r in range(tp_size)]


def test_pools_have_one_tensor_per_component_shaped_layers_rows_unit():
    comps = derive_components(tiny_config("full_swa_mamba"), dtype=torch.float64)
    sizes = pool_sizes(comps, page_size=4, kv_capacity_tokens=30, mamba_slots=3, swa_capacity_tokens=12)
    pools = allocate_device_pools(comps, sizes)
    assert {n: tuple(t.shape) for n, t in pools.items()} == {
        "full_kv": (1, 32, 2, 2, 8),  # 30 tokens round up to 8 pages of 4
        "swa_kv": (1, 12, 2, 2, 8),
        "mamba_conv": (2, 3, CONV_DIM, 3),
        "mamba_ssm": (2, 3, 4, 8, 8),
    }
    assert pools["mamba_ssm"].dtype == torch.float64


def test_window_component_holds_at_most_window_minus_one_rows():
    swa = derive_components(tiny_config("swa"))[0]
    assert [swa.live_rows(n) for n in (0, 3, 4, 5, 100)] == [0, 3, 4, 4, 4]
    assert swa.live_positions(100) == range(96, 100)


def test_allocator_invariants_hold_under_random_allocate_and_free():
    rng = random.Random(1234)
    alloc = IndexAllocator("pages", 37)
    mine: dict[str, set[int]] = {}  # the test's own record of who owns what
    for _ in range(1000):
        owner = f"req{rng.randrange(6)}"
        if rng.random() < 0.55:
            n = rng.randrange(0, 9)
            if not alloc.can_allocate(n):
                with pytest.raises(AllocationError):
                    alloc.allocate(owner, n)
                continue
            got = alloc.allocate(owner, n)
            assert len(got) == len(set(got)) == n
            assert not set(got) & set().union(*mine.values())  # never handed out twice
            mine.setdefault(owner, set()).update(got)
        elif mine.get(owner):
            drop = rng.sample(sorted(mine[owner]), rng.randrange(1, len(mine[owner]) + 1))
            alloc.free(owner, drop)
            mine[owner] -= set(drop)
        alloc.check()
        assert alloc.num_free + alloc.num_used == alloc.capacity
        for o, idx in mine.items():
            assert alloc.owned_by(o) == sorted(idx)
        assert alloc.owners() == {o for o, idx in mine.items() if idx}


def test_freeing_an_index_owned_by_someone_else_fails_and_frees_nothing():
    alloc = IndexAllocator("slots", 4)
    a, b = alloc.allocate("a", 2), alloc.allocate("b", 1)
    with pytest.raises(AllocationError, match="owned by 'b'"):
        alloc.free("a", [a[0], b[0]])
    with pytest.raises(AllocationError, match="owned by None"):
        alloc.free("a", [3])  # never allocated
    assert alloc.owned_by("a") == sorted(a) and alloc.owned_by("b") == b
    alloc.free("a", a)
    with pytest.raises(AllocationError):
        alloc.free("a", a[:1])  # double free
    alloc.check()


def test_allocating_more_than_is_free_fails_and_allocates_nothing():
    alloc = IndexAllocator("slots", 3)
    alloc.allocate("a", 2)
    with pytest.raises(AllocationError, match="need 2, 1 free"):
        alloc.allocate("b", 2)
    assert alloc.num_free == 1 and alloc.owners() == {"a"}


def test_allocator_skips_avoided_indices_while_others_are_free():
    a = IndexAllocator("slots", 4)
    first = a.allocate("x", 2)  # [0, 1]
    a.free("x", first)
    assert a.allocate("y", 1) == [1]  # most recently freed first
    a.free("y", [1])
    assert a.allocate("z", 2, avoid={0, 1}) == [2, 3]  # others first, newest-freed order kept
    assert a.allocate("w", 2, avoid={0, 1}) == [1, 0]  # only avoided ones left: taken anyway
    a.check()
    assert a.num_free == 0 and a.owned_by("z") == [2, 3] and a.owned_by("w") == [0, 1]


def test_allocator_avoid_equals_a_whole_list_reference_over_random_histories():
    """The avoid path scans the free list from its end only as far as it must; what it hands
    out and the free order it leaves equal a whole-list reference (newest first, avoided last)."""
    import random

    rng = random.Random(5)
    for _ in range(200):
        a = IndexAllocator("pages", 24)
        held = a.allocate("h", rng.randint(0, 24))
        a.free("h", rng.sample(held, rng.randint(0, len(held))))
        n = rng.randint(0, a.num_free)
        avoid = set(rng.sample(range(24), rng.randint(1, 10)))
        newest = a._free[::-1]
        want = ([i for i in newest if i not in avoid] + [i for i in newest if i in avoid])[:n]
        want_free = [i for i in a._free if i not in set(want)]
        assert a.allocate("x", n, avoid=avoid) == want
        assert a._free == want_free
        a.check()


def test_allocator_check_notices_a_corrupted_free_list():
    """Mutation check: check() must catch an index that is both free and owned."""
    alloc = IndexAllocator("pages", 5)
    got = alloc.allocate("a", 2)
    alloc._free.append(got[0])
    with pytest.raises(AllocationError):
        alloc.check()
