"""PD disaggregation across TP layouts: a prefill replica hands every request to a decode
replica through the object store, re-sharding heads and channels when the two roles have
different TP sizes. Greedy outputs equal the single-process engine token for token, and the
bytes the decode replica imports per request equal the byte formula (full_kv grows with
the prompt, swa_kv is capped at the window, mamba_* is constant).

TP pairs (1,1), (1,2), (2,1), (2,2): one deployment with two decode targets — a TP=1 "decode"
replica and a TP=2 one (role "colocated": the same engine role, named apart because two
"decode" specs would share placement-group names) — and a prefill replica of TP 1, then one
of TP 2 in its place; each pair is run by steering every hand-off to one decode target.
"""
from __future__ import annotations

import pytest

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.config import ModelConfig
from hyrax.cluster.ray_client import client_for
from pd_harness import (
    Run, assert_all_clean, assert_outputs, decode_on, drive, formula_bytes, pd_deployed, row_bytes, stats,
    stats_delta, with_role_tp,
)
from ray_harness import DEMO_MODEL, prompt, reference, replica, uid

pytestmark = pytest.mark.timeout(300)

CONFIG = EngineConfig(deterministic=True)
WINDOW = ModelConfig.from_dir(DEMO_MODEL).sliding_window  # swa_kv keeps the last WINDOW - 1 rows
# shorter than the window, exactly the window, longer than the window (and several pages)
SEQ_LENGTHS, SEQ_MAX = [5, 64, 150], 12  # shorter than the window, then longer
BATCH_LENGTHS, BATCH_MAX = [7, 33, 90, 130], [10, 16, 8, 14]
DECODE_TARGETS = {1: ("decode", 0), 2: ("colocated", 0)}  # decode TP -> (role, replica)


def _check_pair(d, client, prefill_tp: int, prefill_index: int, decode_tp: int) -> None:
    assert next(r.tp for r in d.replicas if (r.role, r.index) == DECODE_TARGETS[decode_tp]) == decode_tp
    seq_prompts = [prompt(n, seed=500 + n) for n in SEQ_LENGTHS]
    batch_prompts = [prompt(n, seed=600 + n) for n in BATCH_LENGTHS]
    want_seq = reference(DEMO_MODEL, CONFIG, seq_prompts, SEQ_MAX)
    want_batch = reference(DEMO_MODEL, CONFIG, batch_prompts, BATCH_MAX)
    rows = row_bytes()
    role, index = DECODE_TARGETS[decode_tp]
    pair = f"{prefill_tp}->{decode_tp}"
    with decode_on(client, client.find_backend(role, index)):
        # one request at a time: the decode replica's byte counters move for this request only
        measured = {}
        for p, want in zip(seq_prompts, want_seq):
            before_d, before_p = stats(d, role, index), stats(d, "prefill", prefill_index)
            [run] = drive(client, [Run(uid(f"pd{prefill_tp}{decode_tp}-seq"), p, SEQ_MAX)])
            assert_outputs([run], [want])
            assert_all_clean(d)  # the prefill replica freed the request once the decode side had it
            dd = stats_delta(before_d, stats(d, role, index))
            dp = stats_delta(before_p, stats(d, "prefill", prefill_index))
            assert dd["transfers_in"] == {"verified": 1}, (pair, dd["transfers_in"])
            assert dp["transfers_out"] == 1 and dd["transfers_out"] == 0, pair
            assert dd["checksum_failures"] == 0 and dd["restore_fallbacks"] == 0, pair
            # the decode side never re-ran the prompt: it generated all but the first token
            assert dd["generation_tokens"] == SEQ_MAX - 1 and dp["generation_tokens"] == 1, pair
            moved = {k: v for k, v in dd["bytes_transferred"].items() if v}
            # exported after the prompt: the state of len(prompt) committed tokens
            assert moved == formula_bytes(len(p)), (pair, len(p), moved, formula_bytes(len(p)))
            # ... which is the sum over the prefill ranks' shards (no KV head is replicated here)
            assert moved == formula_bytes(len(p), tp=prefill_tp), pair
            measured[len(p)] = moved

        # the DESIGN statements, on the measured bytes themselves
        for n, moved in measured.items():
            assert moved["full_kv"] == n * rows["full_kv"], (pair, n)
            assert moved["swa_kv"] == min(n, WINDOW - 1) * rows["swa_kv"], (pair, n)
            assert moved["mamba_conv"] == rows["mamba_conv"] and moved["mamba_ssm"] == rows["mamba_ssm"], (pair, n)
        assert measured[150]["swa_kv"] == measured[64]["swa_kv"] > measured[5]["swa_kv"], pair

        # concurrent requests with mixed lengths: still token for token
        before_d = stats(d, role, index)
        runs = drive(client, [Run(uid(f"pd{prefill_tp}{decode_tp}-b{i}"), p, m)
                              for i, (p, m) in enumerate(zip(batch_prompts, BATCH_MAX))])
        assert_outputs(runs, want_batch)
        dd = stats_delta(before_d, stats(d, role, index))
        assert dd["transfers_in"] == {"verified": len(runs)}, (pair, dd["transfers_in"])
        want_bytes: dict[str, int] = {}
        for p in batch_prompts:
            for k, v in formula_bytes(len(p)).items():
                want_bytes[k] = want_bytes.get(k, 0) + v
        assert {k: v for k, v in dd["bytes_transferred"].items() if v} == want_bytes, pair
        assert_all_clean(d)


@pytest.fixture(scope="module")
def pd_base(demo_deployment):
    """The module's one deployment; `pd` swaps its prefill replica for each prefill TP size. The
    TP=2 decode target is the session demo deployment's TP=2 replica, borrowed (it runs overlap
    scheduling, the `hyrax serve` default; the TP=1 one does not)."""
    from hyrax.cluster.deployment import RoleSpec

    roles = [RoleSpec("prefill", 1, 1), RoleSpec("decode", 1, 1)]
    with pd_deployed(roles, CONFIG, borrowed={"colocated": replica(demo_deployment, "tp2")}) as (d, _):
        yield d


@pytest.fixture(scope="module", params=[1, 2], ids=lambda tp: f"prefill_tp{tp}")
def pd(request, pd_base):
    """The deployment with a prefill replica of TP=param. The decode targets stay; only the
    prefill replica is replaced (a TP=1 <-> TP=2 swap costs one replica's start, not a whole
    PD deployment's). Yields (prefill TP, its replica index, deployment, client over it)."""
    prefill = with_role_tp(pd_base, "prefill", request.param)
    yield request.param, prefill.index, pd_base, client_for(pd_base, "pd-test")


@pytest.mark.parametrize("decode_tp", [1, 2], ids=lambda tp: f"decode_tp{tp}")
def test_pd_greedy_output_and_transferred_bytes_match_reference_and_formula(pd, decode_tp):
    prefill_tp, prefill_index, d, client = pd
    _check_pair(d, client, prefill_tp, prefill_index, decode_tp)
