"""Mutation check for lossless retraction across ranks: one rank of a TP=2 replica silently
leaves a component out of its backups. Restore must notice (incomplete manifest), fall back
to recompute, count it, and still produce the uninterrupted run's output."""
from __future__ import annotations

import pytest

from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from hyrax.actors.engine.selection import Selection
from hyrax.actors.engine.commands import Resume, Retract
from ray_harness import (DEMO_MODEL, Stream, assert_clean, assert_manifest_from_every_rank, call, deployed, prompt,
                         reference, replica, request_info, run_all, stats_delta, uid)

pytestmark = pytest.mark.timeout(300)

# float64: recompute resumes through prefill, which is not bit-identical to decode; in
# float64 the greedy tokens still match the uninterrupted run exactly.
FAULTY = EngineConfig(deterministic=True, dtype="float64", forced_retraction_interval=3,
                      faults=UnsafeFaults(skip_backup_component="mamba_ssm", only_rank=1), allow_unsafe=True)
CLEAN64 = EngineConfig(deterministic=True, dtype="float64")


@pytest.fixture(scope="module")
def faulty_tp2(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    with deployed(DEMO_MODEL, [RoleSpec("faulty-tp2", 1, 2)], FAULTY) as d:
        yield replica(d, "faulty-tp2").coordinator


def test_backup_missing_a_component_on_one_rank_is_detected_and_output_stays_correct(faulty_tp2):
    coord = faulty_tp2
    lengths, max_tokens = [7, 40, 90], [20, 16, 18]
    prompts = [prompt(n, seed=800 + n) for n in lengths]
    want = reference(DEMO_MODEL, CLEAN64, prompts, max_tokens)
    before = call(coord.stats)
    streams = run_all(coord, prompts, max_tokens, prefix="mut-")
    d = stats_delta(before, call(coord.stats))
    assert d["retractions_by"].get("forced/cpu_tensor", 0) > 0, d
    assert d["restore_fallbacks"] > 0, d
    assert d["restores_by"].get("fallback", 0) == d["restore_fallbacks"], d
    assert d["restores_by"].get("verified", 0) == 0, d  # never resumed on partial state
    assert [s.finish_reason for s in streams] == ["length"] * len(prompts)
    assert [s.tokens for s in streams] == want
    assert_clean(coord)


def test_manifest_check_notices_the_component_one_rank_left_out(faulty_tp2):
    """The check used on healthy replicas (test_retraction_tp2) fails on this manifest."""
    coord = faulty_tp2
    p = prompt(30, seed=901)
    want = reference(DEMO_MODEL, CLEAN64, [p], 40)[0]
    s = Stream(coord, uid("mut-held"), p, 40)
    s.wait_tokens(3)
    assert call(coord.run, Retract(Selection(ids=(s.id,)), hold=True)) == {s.id: "cpu_tensor"}
    m = request_info(coord, s.id)["backup"]
    assert sorted(m["components"]["mamba_ssm"]["checksums"]) == ["0"]
    assert sorted(m["components"]["mamba_conv"]["checksums"]) == ["0", "1"]
    with pytest.raises(AssertionError, match="mamba_ssm"):
        assert_manifest_from_every_rank(m, ["full_kv", "swa_kv", "mamba_conv", "mamba_ssm"], tp=2)
    assert call(coord.run, Resume(Selection(ids=(s.id,)))) == {s.id: "fallback"}
    s.wait_done()
    assert s.tokens == want
    assert_clean(coord)
