"""Lossless retraction: forced and memory-pressure retraction in every layout and backup
mode give the same greedy tokens as the uninterrupted run, and the counters prove that
retractions and verified restores really happened."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import (
    HYBRID, LAYOUTS, MAX_TOKENS, assert_idle_clean, greedy, make_engine, make_prompts,
    reference_outputs, run_requests, tiny_model,
)

MODES = ("cpu_tensor", "host_pool", "recompute")


def _dtype(mode: str) -> torch.dtype:
    # recompute replays through the prefill path, which is not bit-identical to decode:
    # float64 keeps greedy near-ties out of the way. The state-keeping modes must be exact
    # in float32.
    return torch.float64 if mode == "recompute" else torch.float32


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_forced_retraction_every_3_steps_matches_uninterrupted_run(layout, mode):
    dtype = _dtype(mode)
    model = tiny_model(layout, dtype)
    prompts = make_prompts(9, seed=1)
    ref = reference_outputs(layout, dtype, prompts)
    e = make_engine(model, forced_retraction_interval=3, retraction_backup=mode)
    out = run_requests(e, prompts, greedy())
    assert out == ref
    assert all(len(o) == MAX_TOKENS for o in out)

    s = e.stats.summary()
    assert s["retractions"] >= 3, s
    assert set(s["retractions_by"]) == {f"forced/{mode}"}, s
    assert s["restore_fallbacks"] == 0 and s["checksum_failures"] == 0 and s["host_pool_full"] == 0, s
    assert any(r.retractions > 0 for r in e.finished_requests.values())
    names = {c.name for c in model.components}
    if mode == "recompute":
        assert s["restores_by"] == {"recompute": s["retractions"]}, s
        assert s["bytes_backed_up"] == {}, s
    else:
        assert s["restores"] == s["retractions"] and s["restores_by"] == {"verified": s["retractions"]}, s
        # every component of the layout was backed up, and every byte came back
        assert set(s["bytes_backed_up"]) == names, s
        assert s["bytes_restored"] == s["bytes_backed_up"], s


def test_nondeterministic_forced_retraction_matches_nondeterministic_run():
    # Batched (not batch-invariant) execution: retraction changes batch composition and
    # prefill chunking, so logits may differ in the last bits; float64 keeps ties away.
    layout, dtype = HYBRID, torch.float64
    prompts = make_prompts(9, seed=2)
    ref = reference_outputs(layout, dtype, prompts, deterministic=False)
    e = make_engine(tiny_model(layout, dtype), deterministic=False, forced_retraction_interval=3,
                    retraction_backup="cpu_tensor")
    assert run_requests(e, prompts, greedy()) == ref
    s = e.stats.summary()
    assert s["retractions"] >= 3 and s["restores"] == s["retractions"], s


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("layout", ["full", HYBRID])
def test_memory_pressure_retracts_and_every_request_completes_with_unpressured_output(layout, mode):
    dtype = _dtype(mode)
    prompts = make_prompts(16, seed=3, lo=3, hi=30)
    ref = reference_outputs(layout, dtype, prompts, max_tokens=12)
    # 16 requests need ~ 16 * (17 + 12) tokens; 96 tokens of pages hold a few at a time,
    # but the largest request (30 + 12 tokens) always fits alone.
    e = make_engine(tiny_model(layout, dtype), kv_capacity_tokens=96, retraction_backup=mode)
    total = sum(len(p) + 12 for p in prompts)
    assert total > 2 * 96
    out = run_requests(e, prompts, greedy(12))
    assert out == ref
    s = e.stats.summary()
    assert s["retractions_by"].get(f"memory/{mode}", 0) > 0, s
    assert s["finished"] == {"length": 16}, s
    assert s["restore_fallbacks"] == 0 and s["checksum_failures"] == 0, s
    if mode != "recompute":
        assert s["restores"] == s["retractions"], s


def test_host_pool_too_small_falls_back_to_recompute_without_leaking():
    layout, dtype = HYBRID, torch.float64
    prompts = make_prompts(9, seed=4)
    ref = reference_outputs(layout, dtype, prompts)
    e = make_engine(tiny_model(layout, dtype), forced_retraction_interval=3, retraction_backup="host_pool",
                    host_pool_mb=0.001)
    out = run_requests(e, prompts, greedy())
    assert out == ref
    s = e.stats.summary()
    assert s["retractions"] >= 3, s
    assert s["host_pool_full"] == s["retractions"], s
    assert s["retractions_by"] == {"forced/recompute": s["retractions"]}, s
    assert s["restores_by"] == {"recompute": s["retractions"]}, s
    assert_idle_clean(e)


@pytest.mark.parametrize("mode", MODES)
def test_admin_retraction_of_every_request_in_prefill_and_decode_matches_uninterrupted_run(mode):
    # Forced retraction always picks the same victims (fewest outputs, longest prompt);
    # here every request is retracted once in decode, and once mid-prompt when its prompt
    # takes more than one prefill chunk. One retraction per step.
    layout, dtype = HYBRID, _dtype(mode)
    prompts = make_prompts(8, seed=5)
    ref = reference_outputs(layout, dtype, prompts)
    e = make_engine(tiny_model(layout, dtype), retraction_backup=mode)
    ids = [e.add_request(p, greedy()) for p in prompts]
    done: set[tuple[str, str]] = set()
    while e.has_unfinished():
        e.step()
        e.check_invariants()
        for r in sorted(e.running, key=lambda r: r.arrival):
            phase = "prefill" if r.num_computed < len(r.prompt_ids) else "decode"
            if (r.id, phase) not in done:
                done.add((r.id, phase))
                assert e.retract([r.id]) == {r.id: mode}
                break
    assert_idle_clean(e)
    assert [e.finished_requests[i].output_ids for i in ids] == ref
    assert {rid for rid, ph in done if ph == "decode"} == set(ids)
    assert sum(ph == "prefill" for _, ph in done) >= 2
    s = e.stats.summary()
    assert s["retractions_by"] == {f"admin/{mode}": len(done)}, s
    restored = "recompute" if mode == "recompute" else "verified"
    assert s["restores_by"] == {restored: len(done)} and s["restore_fallbacks"] == 0, s


def test_forced_retraction_never_retracts_the_last_running_request():
    prompt = make_prompts(1, seed=15)[0]
    ref = reference_outputs(HYBRID, torch.float32, [prompt])
    e = make_engine(tiny_model(HYBRID), forced_retraction_interval=1)
    assert run_requests(e, [prompt], greedy()) == ref
    assert e.stats.summary()["retractions"] == 0
