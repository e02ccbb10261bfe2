"""The prefix cache on real model families at TP 2, and across a prefill -> decode hand-off:
a later request sharing a cached prefix copies its Mamba2 / Gated DeltaNet checkpoint (written
and checksummed on both ranks) and gives transformers' tokens, as the uncached run does."""
from __future__ import annotations

import pytest
import torch

import hf_families as hff
from engine_helpers import assert_idle_clean, greedy

pytest.importorskip("transformers")
from test_models_checkpoints import FAMILIES  # noqa: E402

PAGE = 4  # hf_families' BASE_CONFIG page size
INTERVAL = 8


@pytest.fixture(scope="module", params=["nemotron_h", "qwen3_next"])
def family(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = hff.randomize_hf_(FAMILIES[request.param]().eval())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    base = hff.prompts((18,), seed=4)[0]
    # the first prompt caches its prefix; the others share 16 of its tokens, or all 18
    ps = [base, base[:16] + hff.prompts((5,), seed=5)[0], base[:16] + hff.prompts((9,), seed=6)[0], list(base)]
    return path, ps, [hff.hf_generate(hf, p) for p in ps]


def _two_waves(engine, ps):
    """The first prompt alone (its prefix stays cached), then the rest (run_to_end checks
    invariants every step, then idle-clean, and flushes)."""
    return _two_waves_rest(engine, engine.add_request(ps[0], greedy(hff.NEW_TOKENS)), ps)


@pytest.mark.parametrize("stress", [{}, {"overlap": True, "forced_retraction_interval": 3}],
                         ids=["plain", "overlap_forced_retraction"])
def test_tp2_hits_copy_checkpoints_written_on_both_ranks(family, stress):
    path, ps, ref = family
    engine = hff.make_engine(path, 2, mamba_track_interval=INTERVAL, **stress)
    seen = []
    real = engine.caching.tree.insert

    def spy(ids, full, window, checkpoints, *held):
        seen.extend(ck.checksums for ck in checkpoints.values())
        return real(ids, full, window, checkpoints, *held)

    engine.caching.tree.insert = spy
    assert _two_waves(engine, ps) == ref
    s = engine.stats.summary()["prefix_cache"]
    assert s["hits"] >= 3 and s["hit_tokens"] >= 3 * 16 and s["corrupt_checkpoints"] == 0, s
    assert seen and all(set(per_rank) == {0, 1} for sums in seen for per_rank in sums.values())


def test_prefill_replica_caches_and_hands_off_to_decode(family):
    """PD: the prefill replica (TP 1) caches prompts; a later request hits there, and its state
    (shared pages included) is handed to a TP 2 decode replica that verifies every component."""
    path, ps, ref = family
    prefill = hff.make_engine(path, 1, role="prefill", mamba_track_interval=INTERVAL)
    decode = hff.make_engine(path, 2, role="decode")
    outs = []
    for wave in (ps[:1], ps[1:]):
        ids = [prefill.add_request(p, greedy(hff.NEW_TOKENS)) for p in wave]
        hff.hand_off_all(prefill, decode, ids)
        outs += hff.run_to_end(decode, ids)
    assert outs == ref
    assert prefill.stats.summary()["prefix_cache"]["hits"] >= 3
    assert decode.stats.summary()["prefix_cache"]["query_tokens"] == 0  # decode replicas never match
    assert_idle_clean(prefill)


def test_checkpoints_inside_one_chunk_hit_with_transformers_tokens(family):
    """Not deterministic (TP 1): the first 18-token prompt prefills in one 32-token chunk and its
    Mamba2 / Gated DeltaNet layers write the checkpoints at 8 and 16 inside it; the others hit
    there and give transformers' tokens."""
    path, ps, ref = family
    engine = hff.make_engine(path, 1, mamba_track_interval=INTERVAL, deterministic=False, prefill_chunk=32,
                             max_batch_tokens=64)
    rid = engine.add_request(ps[0], greedy(hff.NEW_TOKENS))
    engine.step()
    assert engine.requests[rid].num_computed == len(ps[0])  # the whole prompt in one step
    assert engine.stats.prefix.checkpoints == 2  # 8 and 16 (its last whole page), inside the chunk
    assert _two_waves_rest(engine, rid, ps) == ref
    s = engine.stats.summary()["prefix_cache"]
    assert s["hits"] >= 3 and s["hit_tokens"] >= 3 * 16 and s["corrupt_checkpoints"] == 0, s


def _two_waves_rest(engine, rid, ps):
    """Finish the first prompt's request, then run the rest as `_two_waves` does."""
    while engine.has_unfinished():
        engine.step()
        engine.check_invariants()
    rest = [engine.add_request(p, greedy(hff.NEW_TOKENS)) for p in ps[1:]]
    return [engine.finished_requests[rid].output_ids] + hff.run_to_end(engine, rest)
