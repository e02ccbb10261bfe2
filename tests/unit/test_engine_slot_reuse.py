"""Restore after slot reuse (the first seed's bug) and the mutation checks that prove these
tests can see broken backups and restores.

The scenario (engine_helpers.slot_reuse_scenario): A decodes, is retracted and held; B is
admitted into A's freed indices (allocators hand out the most recently freed index first) and decodes, overwriting them; A is
resumed while B still runs. Float64 models, so a recompute fallback reproduces greedy
outputs too.
"""
from __future__ import annotations

import pytest
import torch

from engine_helpers import (
    HYBRID, HYBRID_COMPONENTS, assert_idle_clean, greedy, make_engine, make_prompts, reference_a_b,
    reference_outputs, run_requests, slot_reuse_scenario, tiny_model,
)
from hyrax.actors.engine.config import UnsafeFaults
from hyrax.actors.engine.local import run_to_completion
from hyrax.actors.model.errors import HyraxInputError

DTYPE = torch.float64
SLOTS = ("mamba_conv", "mamba_ssm")
PAGED = ("full_kv", "swa_kv")


def _hybrid():
    return tiny_model(HYBRID, DTYPE)


def _unsafe(**faults) -> dict:
    return dict(faults=UnsafeFaults(**faults), allow_unsafe=True)


def _assert_b_took_a_s_indices(r) -> None:
    for c in SLOTS:
        assert r.b_indices[c] == r.a_old[c], (c, r.b_indices[c], r.a_old[c])
    for c in PAGED:
        assert set(r.b_indices[c]) & {p for p in r.a_old[c] if p >= 0}, (c, r.b_indices[c], r.a_old[c])


@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool", "recompute"])
def test_restore_after_slot_reuse_matches_uninterrupted_run(mode):
    ref_a, ref_b = reference_a_b(HYBRID, DTYPE)
    r = slot_reuse_scenario(_hybrid(), retraction_backup=mode)
    assert r.retract_mode == mode
    _assert_b_took_a_s_indices(r)
    assert r.out_a == ref_a
    assert r.out_b == ref_b  # restoring A did not touch B's state
    s = r.engine.stats.summary()
    assert s["retractions_by"] == {f"admin/{mode}": 1}, s
    if mode == "recompute":
        assert r.resume_result == "recompute" and s["restores_by"] == {"recompute": 1}, s
    else:
        assert r.resume_result == "verified" and s["restores"] == 1, s
        for c in SLOTS:  # restored into a new slot, not the one B now owns
            assert r.a_new[c] != r.a_old[c] and r.a_new[c] != r.b_indices[c], c
    assert s["restore_fallbacks"] == 0 and s["checksum_failures"] == 0, s


def test_slot_reuse_scenario_without_verification_alone_is_still_correct():
    # Control for the mutation checks below: turning verification off does not by itself
    # change the output, so a wrong output there comes from the injected fault.
    ref_a, ref_b = reference_a_b(HYBRID, DTYPE)
    r = slot_reuse_scenario(_hybrid(), **_unsafe(disable_verification=True))
    assert r.resume_result == "verified"
    assert (r.out_a, r.out_b) == (ref_a, ref_b)


# ---- skip one component in backup ----------------------------------------------------------

@pytest.mark.parametrize("component", HYBRID_COMPONENTS)
@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool"])
def test_backup_missing_a_component_is_detected_at_restore_and_recomputed(component, mode):
    ref_a, ref_b = reference_a_b(HYBRID, DTYPE)
    r = slot_reuse_scenario(_hybrid(), retraction_backup=mode, **_unsafe(skip_backup_component=component))
    assert r.resume_result == "fallback"
    s = r.engine.stats.summary()
    assert s["restore_fallbacks"] == 1 and s["restores"] == 0, s
    assert (r.out_a, r.out_b) == (ref_a, ref_b)


@pytest.mark.parametrize("component", HYBRID_COMPONENTS)
def test_backup_missing_a_component_without_verification_gives_wrong_output(component):
    # Mutation check: proves test_backup_missing_a_component_is_detected... can fail.
    ref_a, _ = reference_a_b(HYBRID, DTYPE)
    r = slot_reuse_scenario(_hybrid(), **_unsafe(skip_backup_component=component, disable_verification=True))
    assert r.resume_result == "verified"  # trusted blindly
    assert r.out_a != ref_a


@pytest.mark.parametrize("component", HYBRID_COMPONENTS)
def test_backup_missing_a_component_is_detected_under_forced_retraction(component):
    prompts = make_prompts(8, seed=6)
    ref = reference_outputs(HYBRID, DTYPE, prompts)
    e = make_engine(_hybrid(), forced_retraction_interval=3, **_unsafe(skip_backup_component=component))
    assert run_requests(e, prompts, greedy()) == ref
    s = e.stats.summary()
    assert s["retractions"] >= 3 and s["restore_fallbacks"] == s["retractions"] and s["restores"] == 0, s
    assert s["restores_by"] == {"fallback": s["retractions"]}, s


# ---- restore into the old indices ----------------------------------------------------------

@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool"])
def test_restore_into_old_indices_is_detected_and_recomputed(mode):
    ref_a, ref_b = reference_a_b(HYBRID, DTYPE)
    r = slot_reuse_scenario(_hybrid(), retraction_backup=mode, **_unsafe(restore_into_old_indices=True))
    _assert_b_took_a_s_indices(r)
    assert r.resume_result == "fallback"
    s = r.engine.stats.summary()
    assert s["restore_fallbacks"] == 1 and s["restores"] == 0, s
    assert (r.out_a, r.out_b) == (ref_a, ref_b)  # B's state was not overwritten either


def test_restore_into_old_indices_without_verification_gives_wrong_output():
    # Mutation check: A's backup lands on B's indices (B took them), A runs on stale rows.
    ref_a, ref_b = reference_a_b(HYBRID, DTYPE)
    r = slot_reuse_scenario(_hybrid(), **_unsafe(restore_into_old_indices=True, disable_verification=True))
    _assert_b_took_a_s_indices(r)
    assert r.resume_result == "verified"
    assert r.out_a != ref_a
    assert r.out_b != ref_b


# ---- corrupt a backup ----------------------------------------------------------------------

@pytest.mark.parametrize("component", HYBRID_COMPONENTS)
@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool"])
def test_corrupted_backup_fails_its_checksum_and_is_recomputed(component, mode):
    ref_a, ref_b = reference_a_b(HYBRID, DTYPE)
    r = slot_reuse_scenario(_hybrid(), retraction_backup=mode, **_unsafe(corrupt_backup_component=component))
    assert r.resume_result == "checksum_mismatch"
    s = r.engine.stats.summary()
    assert s["checksum_failures"] == 1 and s["restore_fallbacks"] == 1 and s["restores"] == 0, s
    assert (r.out_a, r.out_b) == (ref_a, ref_b)


def test_fault_injection_is_refused_without_the_unsafe_switch():
    for faults in (UnsafeFaults(skip_backup_component="mamba_ssm"), UnsafeFaults(restore_into_old_indices=True),
                   UnsafeFaults(corrupt_backup_component="full_kv"), UnsafeFaults(disable_verification=True)):
        with pytest.raises(HyraxInputError):
            make_engine(_hybrid(), faults=faults)


def test_fault_injection_names_must_be_components_of_the_model():
    for faults in (UnsafeFaults(skip_backup_component="mamba_conv,mamba_state"),
                   UnsafeFaults(corrupt_backup_component="kv")):
        with pytest.raises(HyraxInputError, match="unknown component"):
            make_engine(_hybrid(), **_unsafe(**faults.__dict__))
    with pytest.raises(HyraxInputError, match="unknown component"):
        make_engine(tiny_model("full", DTYPE), **_unsafe(skip_backup_component="mamba_ssm"))


def test_dropping_the_whole_mamba_state_is_detected_at_restore_and_recomputed():
    """The seeds' bug (both Mamba components left behind) with verification on: every restore
    falls back to recompute and the output equals the uninterrupted run."""
    prompts = make_prompts(4, 5)
    want = reference_outputs(HYBRID, DTYPE, prompts, 10)
    e = make_engine(_hybrid(), forced_retraction_interval=2, **_unsafe(skip_backup_component="mamba_conv,mamba_ssm"))
    got = run_requests(e, prompts, greedy(10))
    s = e.stats.summary()
    assert got == want
    assert s["retractions"] > 0 and s["restore_fallbacks"] == s["retractions"] and s["restores"] == 0, s
    assert_idle_clean(e)


@pytest.mark.parametrize("layout", ["mamba", HYBRID])
def test_slot_of_a_finished_request_is_zeroed_before_reuse(layout):
    # One slot: every request runs in the slot its predecessor left full of state. Prompts
    # are 1-4 tokens: over a longer prompt the recurrent state forgets a stale start (checked:
    # without zeroing, requests 2-4 here give different tokens).
    prompts = make_prompts(4, seed=14, lo=1, hi=4)
    ref = reference_outputs(layout, DTYPE, prompts)
    e = make_engine(tiny_model(layout, DTYPE), mamba_slots=1)
    ids = [e.add_request(p, greedy()) for p in prompts]
    slots = set()
    while e.has_unfinished():
        e.step()
        e.check_invariants()
        assert len(e.running) <= 1
        slots |= {r.indices["mamba_ssm"][0] for r in e.running}
    assert_idle_clean(e)
    assert slots == {0}
    assert [e.finished_requests[i].output_ids for i in ids] == ref


def test_a_restore_lands_in_new_indices_whenever_the_pools_have_other_room():
    """Retract and resume at once: the allocators hand out the most recently freed index
    first, which would give the request its own old slot and pages back (still holding its
    bytes, so a backup that dropped a component would look lossless). Restores avoid them."""
    e = make_engine(_hybrid())
    aid = e.add_request(make_prompts(1, 11)[0], greedy(12))
    a = e.requests[aid]
    while len(a.output_ids) < 4:
        e.step()
    old = {c: [i for i in v if i >= 0] for c, v in a.indices.items()}
    assert e.retract([aid])[aid] == "cpu_tensor"
    assert e.resume([aid])[aid] == "verified"
    for c in HYBRID_COMPONENTS:
        new = [i for i in a.indices[c] if i >= 0]
        assert new and not set(new) & set(old[c]), (c, old[c], new)
    run_to_completion(e)
    assert_idle_clean(e)

