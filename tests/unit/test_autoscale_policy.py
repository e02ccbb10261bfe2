"""The autoscaling policy (issue 20): scale up only after a sustained queue (or a full pool),
down only after a sustained lull that the remaining replicas can absorb, never past the bounds,
and never flapping: every change resets both streaks."""
from __future__ import annotations

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.autoscale import Autoscaler, ReplicaLoad, ScalePolicy

BUSY = ReplicaLoad(waiting=4, held=6, pool_usage=0.3)
IDLE = ReplicaLoad(waiting=0, held=0, pool_usage=0.0)


def test_a_sustained_queue_adds_one_replica_and_a_blip_adds_none():
    s = Autoscaler(ScalePolicy(1, 3, up_after=3, down_after=5))
    assert [s.decide([BUSY]), s.decide([IDLE]), s.decide([BUSY]), s.decide([BUSY])] == [0, 0, 0, 0]
    assert s.decide([BUSY]) == 1
    assert s.decide([BUSY, IDLE]) == 0  # streak reset by the change


def test_a_full_pool_counts_as_overload():
    s = Autoscaler(ScalePolicy(1, 2, up_after=2))
    full = ReplicaLoad(waiting=0, held=2, pool_usage=0.9)
    assert [s.decide([full]), s.decide([full])] == [0, 1]


def test_a_sustained_lull_retires_one_and_never_below_the_minimum():
    s = Autoscaler(ScalePolicy(1, 3, up_after=3, down_after=3))
    light = ReplicaLoad(waiting=0, held=1, pool_usage=0.1)
    assert [s.decide([light, light]) for _ in range(3)] == [0, 0, -1]
    assert [s.decide([light]) for _ in range(5)] == [0] * 5  # at the minimum
    heavy = ReplicaLoad(waiting=0, held=3, pool_usage=0.1)  # 6 held do not fit one replica at 2 each
    assert [s.decide([heavy, heavy]) for _ in range(5)] == [0] * 5


def test_the_bounds_are_restored_first_and_checked_once():
    assert Autoscaler(ScalePolicy(2, 3)).decide([IDLE]) == 1
    assert Autoscaler(ScalePolicy(1, 1)).decide([BUSY, IDLE]) == -1
    with pytest.raises(HyraxInputError):
        ScalePolicy(3, 2)


def test_a_prefill_replica_is_overloaded_by_the_prompts_it_holds():
    """A prefill replica admits every prompt at once (nothing waits for admission): its load is
    the prompts in prefill. The decode-style policy would never scale it up."""
    prefilling = ReplicaLoad(waiting=0, held=20, pool_usage=0.2)
    decode_style = Autoscaler(ScalePolicy(1, 2, up_after=2))
    assert [decode_style.decide([prefilling]) for _ in range(5)] == [0] * 5
    prefill = Autoscaler(ScalePolicy(1, 2, up_after=2, up_held_per_replica=8.0))
    assert [prefill.decide([prefilling]), prefill.decide([prefilling])] == [0, 1]
    assert Autoscaler(ScalePolicy(1, 2, up_after=1, up_held_per_replica=8.0)).decide(
        [ReplicaLoad(waiting=0, held=6, pool_usage=0.2)]) == 0


def test_serve_gives_the_prefill_role_the_held_signal():
    import argparse

    from hyrax.cluster.serve import PREFILL_HELD_PER_REPLICA, scale_policies
    from hyrax.cluster.placement import RoleSpec

    a = argparse.Namespace(min_replicas=1, max_replicas=2, min_prefill_replicas=1, max_prefill_replicas=2)
    got = scale_policies(a, [RoleSpec("prefill", 1, 1), RoleSpec("decode", 1, 1)])
    assert got["prefill"].up_held_per_replica == PREFILL_HELD_PER_REPLICA
    assert got["decode"].up_held_per_replica is None
