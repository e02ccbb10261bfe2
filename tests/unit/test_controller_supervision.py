"""The deployment controller's bookkeeping that needs no Ray (issue 20): when a silent replica
counts as hung, how its replicas' placement groups are named and found again after a restart,
and the autoscaling flags of both roles."""
from __future__ import annotations

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.cli import build_parser
from hyrax.cluster.deployment import parse_group_name
from hyrax.cluster.serve import scale_policies, supervision_from_args, validate
from hyrax.cluster.supervision import Check, HealthTracker, ReplaceBackoff, Supervision, Verdict


def test_a_replica_is_hung_only_after_staying_silent_for_the_whole_timeout():
    t = HealthTracker(Supervision(interval_s=2, health_timeout_s=5, hung_after_s=15))
    assert t.judge("d/0", Check.ANSWERED, 100.0) is Verdict.ALIVE
    assert t.judge("d/0", Check.SILENT, 107.0) is Verdict.SILENT
    assert t.judge("d/0", Check.SILENT, 114.9) is Verdict.SILENT
    assert t.judge("d/0", Check.SILENT, 115.0) is Verdict.HUNG
    # an answer in between starts the count again
    assert t.judge("d/1", Check.ANSWERED, 100.0) is Verdict.ALIVE
    assert t.judge("d/1", Check.SILENT, 112.0) is Verdict.SILENT
    assert t.judge("d/1", Check.ANSWERED, 114.0) is Verdict.ALIVE
    assert t.judge("d/1", Check.SILENT, 120.0) is Verdict.SILENT


def test_a_replica_silent_from_its_first_check_counts_that_check_and_death_is_at_once():
    t = HealthTracker(Supervision(health_timeout_s=5, hung_after_s=10))
    assert t.judge("p/0", Check.SILENT, 50.0) is Verdict.SILENT  # silent for 5 s already
    assert t.judge("p/0", Check.SILENT, 55.0) is Verdict.HUNG
    assert t.judge("p/1", Check.ANSWERED, 50.0) is Verdict.ALIVE
    assert t.judge("p/1", Check.DIED, 51.0) is Verdict.DEAD
    assert "p/1" not in t.last_answer and "p/0" not in t.last_answer  # a replaced replica is forgotten


def test_a_replica_that_answers_it_is_down_is_judged_down_at_once():
    t = HealthTracker(Supervision())
    assert t.judge("d/0", Check.ANSWERED, 10.0) is Verdict.ALIVE
    assert t.judge("d/0", Check.DOWN, 12.0) is Verdict.DOWN
    assert "d/0" not in t.last_answer


def test_failed_replacements_of_a_role_wait_twice_as_long_each_time_up_to_the_cap():
    b = ReplaceBackoff(Supervision(interval_s=2.0, retry_max_s=10.0))
    assert b.due("decode", 0.0) and b.due("prefill", 0.0)
    waits = [b.failed("decode", t) for t in (0.0, 2.0, 6.0, 14.0, 24.0)]
    assert waits == [2.0, 4.0, 8.0, 10.0, 10.0]
    assert not b.due("decode", 33.9) and b.due("decode", 34.0)
    assert b.due("prefill", 1.0)  # each role its own
    b.succeeded("decode")
    assert b.due("decode", 0.0) and b.failed("decode", 40.0) == 2.0


def test_placement_group_names_are_found_again_only_in_their_own_deployment():
    assert parse_group_name("hyrax/decode/3", "hyrax") == ("decode", 3)
    assert parse_group_name("blue/prefill/0", "blue") == ("prefill", 0)
    assert parse_group_name("blue/prefill/0", "hyrax") is None  # another deployment's
    assert parse_group_name("hyrax/decode/x", "hyrax") is None
    assert parse_group_name("hyrax/decode/0/coordinator", "hyrax") is None
    assert parse_group_name("", "hyrax") is None


def test_prefill_autoscaling_flags_give_the_prefill_role_its_own_policy():
    parser = build_parser()
    a = parser.parse_args(["serve", "--prefill-replicas", "2", "--min-prefill-replicas", "1",
                           "--max-prefill-replicas", "3", "--min-replicas", "1", "--max-replicas", "2"])
    validate(a)
    from hyrax.cluster.serve import largest, roles_from_args
    from hyrax.actors.model.config import ModelConfig
    from hyrax.actors.model.demo import resolve_model_path

    roles = roles_from_args(a, ModelConfig.from_dir(resolve_model_path("demo")))
    policies = scale_policies(a, roles)
    assert {r: (p.min_replicas, p.max_replicas) for r, p in policies.items()} == {"prefill": (1, 3), "decode": (1, 2)}
    assert [(r.name, r.replicas) for r in largest(roles, policies)] == [("prefill", 3), ("decode", 2)]
    with pytest.raises(HyraxInputError, match="--min-prefill-replicas and --max-prefill-replicas go together"):
        validate(parser.parse_args(["serve", "--min-prefill-replicas", "1"]))
    with pytest.raises(HyraxInputError, match="outside --min-prefill-replicas"):
        validate(parser.parse_args(["serve", "--prefill-replicas", "3", "--min-prefill-replicas", "1",
                                    "--max-prefill-replicas", "2"]))
    with pytest.raises(HyraxInputError, match="--colocated"):
        validate(parser.parse_args(["serve", "--colocated", "--min-prefill-replicas", "1", "--max-prefill-replicas", "2"]))
    with pytest.raises(HyraxInputError, match="min <= max"):
        validate(parser.parse_args(["serve", "--min-prefill-replicas", "0", "--max-prefill-replicas", "2"]))


def test_hung_replica_timeout_sets_the_supervision_and_must_cover_a_health_check(capsys):
    parser = build_parser()
    s = supervision_from_args(parser.parse_args(["serve"]))
    assert (s.health_timeout_s, s.hung_after_s) == (5.0, 15.0)
    s = supervision_from_args(parser.parse_args(["serve", "--hung-replica-timeout", "3"]))
    assert (s.health_timeout_s, s.hung_after_s) == (3.0, 3.0)
    with pytest.raises(SystemExit):  # refused as it is parsed
        parser.parse_args(["serve", "--hung-replica-timeout", "0"])
    assert "argument --hung-replica-timeout: must be a finite number > 0, got '0'" in capsys.readouterr().err
