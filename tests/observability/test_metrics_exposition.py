"""GET /metrics after a real prefill/decode run with forced retraction (fixture `pd_run`):
the text parses, every documented metric is there with its type and labels, and the
counters moved by exactly what happened — judged against the responses the client got,
the byte formula, and the coordinators' own stats, not against the exporter's source."""
from __future__ import annotations

from collections import Counter

import pytest

from obs_harness import (
    DEMO_MODEL, FORCED_INTERVAL, PD_REQUESTS, METRICS_MD, documented_metrics, missing_documented, parse_families, value,
)


@pytest.fixture(scope="module")
def fams(pd_run):
    return parse_families(pd_run.metrics_text)


@pytest.fixture(scope="module")
def documented():
    return documented_metrics(METRICS_MD.read_text())


def _roles(pd_run) -> dict[str, dict]:
    return {role: s for (role, _), s in pd_run.stats.items()}


# ---- the exposition ------------------------------------------------------------------------
def test_scrape_is_prometheus_text_that_prometheus_client_parses(pd_run, fams):
    assert pd_run.content_type.startswith("text/plain"), pd_run.content_type
    assert all(name.startswith("hyrax_") for name in fams), sorted(n for n in fams if not n.startswith("hyrax_"))
    assert len(fams) >= 20


def test_run_left_every_replica_idle_with_clean_pools(pd_run):
    assert pd_run.clean_after
    assert all(r["finish_reason"] == "length" and r["completion_tokens"] == r["max_tokens"]
               for r in pd_run.responses), pd_run.responses


def test_documentation_parser_reads_every_table_row(documented):
    table_rows = [line for line in METRICS_MD.read_text().splitlines() if line.startswith("| `hyrax_")]
    assert len(documented) == len(table_rows) >= 20
    assert {d.type for d in documented.values()} == {"gauge", "counter", "histogram"}
    assert documented["hyrax_retractions"].labels == {"role", "replica", "trigger", "mode"}
    assert documented["hyrax_time_to_first_token_seconds"].labels == frozenset()


def test_every_documented_metric_is_exported_with_its_type_and_labels(documented, fams):
    assert missing_documented(documented, fams) == []


def test_every_exported_metric_is_documented(documented, fams):
    assert sorted(set(fams) - set(documented)) == []


def test_documentation_check_notices_a_missing_or_relabelled_metric(pd_run, documented):
    """Mutation check: the comparison above can fail."""
    kept = [ln for ln in pd_run.metrics_text.splitlines() if "hyrax_transfers_out" not in ln]
    assert missing_documented(documented, parse_families("\n".join(kept) + "\n")) == [
        "hyrax_transfers_out_total: not exported"]
    relabelled = "\n".join(ln.replace(",role=", ",rolle=") if ln.startswith("hyrax_replica_healthy{") else ln
                           for ln in pd_run.metrics_text.splitlines()) + "\n"
    assert relabelled != pd_run.metrics_text
    problems = missing_documented(documented, parse_families(relabelled))
    assert len(problems) == 1 and problems[0].startswith("hyrax_replica_healthy: labels"), problems
    as_gauge = pd_run.metrics_text.replace("# TYPE hyrax_restores_total counter", "# TYPE hyrax_restores_total gauge")
    assert any(p.startswith("hyrax_restores") for p in missing_documented(documented, parse_families(as_gauge)))


# ---- counters against what happened -------------------------------------------------------
def test_token_counters_equal_the_tokens_the_client_received(pd_run, fams):
    completion = sum(r["completion_tokens"] for r in pd_run.responses)
    prompt = sum(r["prompt_tokens"] for r in pd_run.responses)
    assert completion == sum(n for _, n, _ in PD_REQUESTS)
    assert value(fams, "hyrax_generation_tokens_total") == completion
    # the prefill replica samples each request's first token, decode the rest
    assert value(fams, "hyrax_generation_tokens_total", role="prefill") == len(PD_REQUESTS)
    assert value(fams, "hyrax_generation_tokens_total", role="decode") == completion - len(PD_REQUESTS)
    # prompts are accepted once, on prefill; an import is not a new prompt
    assert value(fams, "hyrax_prompt_tokens_total") == prompt
    assert value(fams, "hyrax_prompt_tokens_total", role="decode") == 0


def test_every_request_is_counted_once_as_finished_by_length(pd_run, fams):
    n = len(PD_REQUESTS)
    assert value(fams, "hyrax_requests_finished_total", finish_reason="length") == n
    assert value(fams, "hyrax_requests_finished_total") == n  # no abort, error, or hand-off counted
    # the 1-token request ends on prefill; the handed-off ones end on decode
    assert value(fams, "hyrax_requests_finished_total", role="prefill") == n - len(pd_run.handed_off)
    assert value(fams, "hyrax_requests_finished_total", role="decode") == len(pd_run.handed_off)


def test_forced_retractions_are_counted_as_the_coordinators_report(pd_run, fams):
    forced = value(fams, "hyrax_retractions_total", trigger="forced")
    assert forced > 0, f"no forced retraction with interval {FORCED_INTERVAL}"
    for (role, replica), s in pd_run.stats.items():
        by = Counter({k: v for k, v in s["retractions_by"].items()})
        for key, n in by.items():
            trigger, mode = key.split("/", 1)
            assert value(fams, "hyrax_retractions_total", role=role, replica=replica,
                         trigger=trigger, mode=mode) == n, (role, key)
        assert value(fams, "hyrax_retractions_total", role=role, replica=replica) == s["retractions"]
    assert forced == sum(n for s in pd_run.stats.values() for k, n in s["retractions_by"].items()
                         if k.startswith("forced/"))
    assert value(fams, "hyrax_retractions_total") == forced  # nothing else retracted in this run
    # every forced retraction was backed up (cpu_tensor) and one backup took one duration
    assert value(fams, "hyrax_retractions_total", mode="cpu_tensor") == forced
    assert value(fams, "hyrax_backup_duration_seconds_count") == forced


def test_backed_up_bytes_are_all_restored_and_verified(pd_run, fams):
    comps = {s.labels["component"] for s in fams["hyrax_state_bytes_backed_up"].samples}
    assert comps == {"full_kv", "swa_kv", "mamba_conv", "mamba_ssm"}
    for c in comps:
        backed = value(fams, "hyrax_state_bytes_backed_up_total", component=c)
        assert backed > 0, c
        assert value(fams, "hyrax_state_bytes_restored_total", component=c) == backed, c
    assert value(fams, "hyrax_checksum_failures_total") == 0
    assert value(fams, "hyrax_restores_total", result="fallback") == 0
    assert value(fams, "hyrax_restores_total", result="checksum_mismatch") == 0


def test_restores_count_restored_retractions_not_pd_imports(pd_run, fams):
    """An import (PD hand-off, migration) is a transfer, not a restore: with every forced
    retraction restored and verified, restores equal retractions on every replica, and the
    imports show up only under hyrax_transfers_in_total / hyrax_pd_transfer_duration_seconds."""
    assert value(fams, "hyrax_retractions_total", trigger="forced") > 0
    for role in ("prefill", "decode"):
        retracted = value(fams, "hyrax_retractions_total", role=role)
        assert value(fams, "hyrax_restores_total", role=role, result="verified") == retracted, role
        assert value(fams, "hyrax_restores_total", role=role) == retracted, role
        assert value(fams, "hyrax_restore_duration_seconds_count", role=role) == retracted, role


def test_pd_handoffs_counted_on_prefill_and_bytes_match_the_formula_on_decode(pd_run, fams):
    import torch

    from hyrax.actors.model.config import ModelConfig
    from hyrax.actors.model.sharding import TP
    from hyrax.actors.model.state import bytes_formula, derive_components

    handed = pd_run.handed_off
    assert 0 < len(handed) < len(PD_REQUESTS)
    assert value(fams, "hyrax_transfers_out_total", role="prefill") == len(handed)
    assert value(fams, "hyrax_transfers_out_total", role="decode") == 0
    assert value(fams, "hyrax_transfers_in_total", role="decode", result="verified") == len(handed)
    assert value(fams, "hyrax_transfers_in_total") == len(handed)  # no fallback, no no_capacity
    # one export on prefill and one import on decode per hand-off
    assert value(fams, "hyrax_pd_transfer_duration_seconds_count", role="prefill") == len(handed)
    assert value(fams, "hyrax_pd_transfer_duration_seconds_count", role="decode") == len(handed)

    # the state handed over is the prompt's (the first token is sampled, not yet computed)
    comps = derive_components(ModelConfig.from_dir(DEMO_MODEL), TP(0, 1), torch.float32)
    expect: Counter = Counter()
    for r in handed:
        expect.update(bytes_formula(comps, r["prompt_tokens"]))
    assert len({r["prompt_tokens"] for r in handed}) == len(handed)  # distinct lengths, one > window
    window = ModelConfig.from_dir(DEMO_MODEL).sliding_window
    assert max(r["prompt_tokens"] for r in handed) > window > min(r["prompt_tokens"] for r in handed) + 1
    for c in comps:
        assert value(fams, "hyrax_state_bytes_transferred_total", role="decode", component=c.name) == expect[c.name], c.name
    assert value(fams, "hyrax_state_bytes_transferred_total", role="prefill") == 0
    # the comparison tells the committed-token count apart: one token more is another number
    # for every component kind but the slots (swa_kv: thanks to the prompt shorter than the window)
    off_by_one: Counter = Counter()
    for r in handed:
        off_by_one.update(bytes_formula(comps, r["prompt_tokens"] + 1))
    assert off_by_one["full_kv"] != expect["full_kv"] and off_by_one["swa_kv"] != expect["swa_kv"]


def test_gateway_latency_histograms_observe_each_request(pd_run, fams):
    n = len(PD_REQUESTS)
    completion = sum(r["completion_tokens"] for r in pd_run.responses)
    assert value(fams, "hyrax_time_to_first_token_seconds_count") == n
    assert value(fams, "hyrax_e2e_request_latency_seconds_count") == n
    # one token per engine step per request: every token after the first is one gap
    assert value(fams, "hyrax_inter_token_latency_seconds_count") == completion - n
    for h in ("hyrax_time_to_first_token_seconds", "hyrax_e2e_request_latency_seconds"):
        assert value(fams, f"{h}_sum") > 0
        assert value(fams, f"{h}_bucket", le="+Inf") == n
    # queue time: observed when a request is first scheduled, i.e. once per request on prefill
    assert value(fams, "hyrax_queue_time_seconds_count", role="prefill") == n


def test_histogram_buckets_are_cumulative(fams):
    for name, f in fams.items():
        if f.type != "histogram":
            continue
        series: dict = {}
        for s in f.samples:
            if s.name.endswith("_bucket"):
                key = tuple(sorted((k, v) for k, v in s.labels.items() if k != "le"))
                series.setdefault(key, []).append((float(s.labels["le"]), s.value))
        assert series, name
        for key, buckets in series.items():
            counts = [c for _, c in sorted(buckets)]
            assert counts == sorted(counts), (name, key, buckets)
            assert value(fams, f"{name}_count", **dict(key)) == counts[-1], (name, key)


def test_gauges_after_the_run_show_idle_healthy_replicas(pd_run, fams):
    replicas = {("prefill", "0"), ("decode", "0")}
    for g in ("hyrax_requests_running", "hyrax_requests_waiting", "hyrax_requests_retracted", "hyrax_replica_healthy"):
        assert {(s.labels["role"], s.labels["replica"]) for s in fams[g].samples} == replicas, g
    assert value(fams, "hyrax_requests_running") == 0
    assert value(fams, "hyrax_requests_waiting") == 0
    assert value(fams, "hyrax_requests_retracted") == 0
    assert value(fams, "hyrax_replica_healthy", role="prefill") == 1
    assert value(fams, "hyrax_replica_healthy", role="decode") == 1
    for (role, replica), p in pd_run.pools.items():
        for comp, u in p["components"].items():
            lab = dict(role=role, replica=replica, rank=0, component=comp)
            assert value(fams, "hyrax_pool_free_units", **lab) == u["capacity"], (role, comp)
            assert value(fams, "hyrax_pool_usage_ratio", **lab) == 0.0, (role, comp)
            assert value(fams, "hyrax_host_pool_usage_ratio", **lab) == 0.0, (role, comp)
    # 2 replicas x 1 rank x 4 components, and the prefill replica's 2 prefix-cache checkpoint pools
    # (a decode replica prefills no prompt: it keeps no prefix cache)
    assert {p["role"]: len(p["components"]) for p in pd_run.pools.values()} == {"prefill": 6, "decode": 4}
    assert len(fams["hyrax_pool_usage_ratio"].samples) == 6 + 4
