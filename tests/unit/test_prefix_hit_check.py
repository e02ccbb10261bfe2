"""A prefix-cache hit's checkpoint is checked by every rank inside the step that copies it
(`RankRuntime._verify_hits`), not by a call to the ranks while the coordinator plans: before
the step writes anything, each rank hashes the checkpoint slots the step copies and compares
them with the hashes recorded when they were cached; the verdicts are summed over the TP group
so every rank raises the same `CheckpointMismatch`. The engine then revokes those hits (their
nodes are never matched again) and rebuilds the step's requests by prefill: no request fails,
none sees a token from the changed state."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import HYBRID, greedy, make_engine, run_requests, tiny_model
from hyrax.actors.engine.plan import CheckpointMismatch
from test_prefix_engine import INTERVAL, _family, _waves, _waves_keep


def _cached_engine(overlap: bool):
    """An engine whose cache holds the first prompt's prefix; the prompts of the second wave."""
    prompts = _family(24, 3, seed=3)
    engine = make_engine(tiny_model(HYBRID), mamba_track_interval=INTERVAL, overlap=overlap)
    first = _waves_keep(engine, prompts[:1])
    return engine, first, prompts


def _hit_plans(engine) -> list:
    """Record every plan the rank runs that copies a checkpoint it must check."""
    rank, seen = engine.executor.rank, []
    inner = rank.execute

    def execute(plan):
        if any(cp.expect is not None for cp in plan.copies):
            seen.append(plan)
        return inner(plan)
    rank.execute = execute
    return seen


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_a_changed_checkpoint_fails_its_step_and_the_requests_are_rebuilt_with_the_same_tokens(overlap):
    prompts = _family(24, 3, seed=3)
    off = _waves(make_engine(tiny_model(HYBRID), prefix_cache=False), [prompts[:1], prompts[1:]], greedy(12))
    engine, first, _ = _cached_engine(overlap)
    plans = _hit_plans(engine)
    engine.executor.rank.pools["mamba_ssm.checkpoint"] += 1.0  # every cached recurrent state changed
    rest = run_requests(engine, prompts[1:], greedy(12))  # invariants every step, then idle-clean
    s = engine.caching.stats.summary()
    assert first + rest == off
    assert plans, "no step copied a checkpoint"
    assert s["corrupt_checkpoints"] >= 1 and s["hits"] == 0 and s["hit_tokens"] == 0, s
    assert engine.stats.finished["error"] == 0
    assert engine.stats.step_errors == 0  # a revoked hit is not a failed request


def test_an_unchanged_checkpoint_is_checked_in_its_step_and_hits():
    engine, first, prompts = _cached_engine(False)
    plans = _hit_plans(engine)
    run_requests(engine, prompts[1:], greedy(12))
    s = engine.caching.stats.summary()
    assert plans and s["hits"] >= 1 and s["corrupt_checkpoints"] == 0, s
    # every checked copy carries what each rank recorded when the checkpoint was cached
    assert all(cp.expect and cp.req_id for p in plans for cp in p.copies if cp.expect is not None)


def _a_hit_plan(engine, prompts):
    """The first plan that copied a checked checkpoint (it ran; its request still holds the rows)."""
    plans = _hit_plans(engine)
    engine.add_request(prompts[1], greedy(40))
    for _ in range(20):
        if plans:
            return plans[0]
        engine.step()
    raise AssertionError("no step copied a checkpoint")


def _pools(rank) -> dict[str, torch.Tensor]:
    return {n: p.clone() for n, p in rank.pools.items()}


def test_the_step_raises_before_it_writes_anything():
    engine, _, prompts = _cached_engine(False)
    plan = _a_hit_plan(engine, prompts)
    rank = engine.executor.rank
    ckpt = next(cp for cp in plan.copies if cp.expect is not None)
    rank.pools[ckpt.src_pool][:, ckpt.src[0]] += 1.0
    before = _pools(rank)
    with pytest.raises(CheckpointMismatch) as e:
        rank.execute(plan)
    assert e.value.req_ids == (ckpt.req_id,)
    assert all(torch.equal(before[n], p) for n, p in rank.pools.items())  # not a byte written


def test_every_rank_raises_when_any_rank_found_a_change():
    """TP: the verdicts are summed over the group, so a rank whose own slots are intact raises
    too (alone it would run the forward and wait for the others in its collectives)."""
    engine, _, prompts = _cached_engine(False)
    plan = _a_hit_plan(engine, prompts)
    rank = engine.executor.rank
    sent = []

    def other_rank_found_one(t: torch.Tensor) -> torch.Tensor:  # the group's sum: another rank saw a change
        sent.append(t.clone())
        return t + 1
    rank.all_reduce = other_rank_found_one
    with pytest.raises(CheckpointMismatch):
        rank._verify_hits(plan.copies)
    assert sent and not sent[0].any()  # this rank's own verdicts: all intact
    rank.all_reduce = lambda t: t  # the group agrees: intact
    rank._verify_hits(plan.copies)


def test_a_checkpoint_without_a_hash_from_this_rank_counts_as_changed():
    import dataclasses

    engine, _, prompts = _cached_engine(False)
    plan = _a_hit_plan(engine, prompts)
    copies = tuple(dataclasses.replace(cp, expect=()) if cp.expect is not None else cp for cp in plan.copies)
    with pytest.raises(CheckpointMismatch):
        engine.executor.rank._verify_hits(copies)


def test_the_hit_counters_only_grow_and_count_a_hit_once_its_step_committed():
    """They are exported as Prometheus counters: a revoked hit is never counted, rather than
    counted and taken back."""
    engine, _, prompts = _cached_engine(True)
    engine.executor.rank.pools["mamba_ssm.checkpoint"] += 1.0
    seen, inner = [], engine.step

    def step():
        out = inner()
        s = engine.caching.stats.summary()
        seen.append((s["hits"], s["hit_tokens"], s["corrupt_checkpoints"]))
        return out
    engine.step = step
    run_requests(engine, prompts[1:], greedy(12))
    assert seen[-1][2] >= 1
    assert all(a <= b for x, y in zip(seen, seen[1:]) for a, b in zip(x, y)), seen
    assert seen[-1][:2] == (0, 0)
