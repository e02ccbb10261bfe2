"""Every PromQL expression of the shipped Grafana dashboard asks only for series that
GET /metrics exports (families parsed from the scrape of a real PD run, fixture `pd_run`),
and the shipped JSON is what dashboards/build_grafana.py generates."""
from __future__ import annotations

import copy
import importlib.util
import json

import pytest

from obs_harness import (
    GRAFANA_JSON, REPO, family_of, grafana_exprs, load_grafana, parse_families, promql_metric_names,
    unknown_series,
)


@pytest.fixture(scope="module")
def fams(pd_run):
    return parse_families(pd_run.metrics_text)


def test_every_grafana_query_names_only_exported_metrics(fams):
    dashboard = load_grafana()
    exprs = grafana_exprs(dashboard)
    assert len(exprs) >= 20
    for title, expr in exprs:
        assert promql_metric_names(expr), f"{title}: {expr} names no hyrax_ metric"
    assert unknown_series(dashboard, fams) == []


def test_grafana_covers_the_retraction_and_transfer_families(fams):
    """The dashboard is where operators see what Hyrax adds: each such family is charted."""
    used = {family_of(n, fams) for _, e in grafana_exprs(load_grafana()) for n in promql_metric_names(e)}
    for fam in ("hyrax_retractions", "hyrax_restores", "hyrax_checksum_failures", "hyrax_state_bytes_transferred",
                "hyrax_transfers_in", "hyrax_transfers_out", "hyrax_pd_transfer_duration_seconds",
                "hyrax_pool_usage_ratio", "hyrax_replica_healthy"):
        assert fam in used, fam


def test_series_names_map_to_families_by_type(fams):
    assert family_of("hyrax_retractions_total", fams) == "hyrax_retractions"
    assert family_of("hyrax_queue_time_seconds_bucket", fams) == "hyrax_queue_time_seconds"
    assert family_of("hyrax_queue_time_seconds_count", fams) == "hyrax_queue_time_seconds"
    assert family_of("hyrax_requests_running", fams) == "hyrax_requests_running"
    # a counter without _total, a histogram by its bare name, a gauge with a histogram suffix:
    # none of these is a series Prometheus would store
    assert family_of("hyrax_retractions", fams) is None
    assert family_of("hyrax_queue_time_seconds", fams) is None
    assert family_of("hyrax_requests_running_bucket", fams) is None


def test_grafana_check_notices_a_query_for_an_unexported_metric(fams):
    """Mutation check: a misspelt or wrongly suffixed series in any panel is reported."""
    base = load_grafana()
    for bad in ("sum(rate(hyrax_retraction_total[5m]))", "rate(hyrax_transfers_out[5m])",
                "histogram_quantile(0.5, rate(hyrax_requests_waiting_bucket[5m]))"):
        d = copy.deepcopy(base)
        d["panels"][-1]["targets"].append({"expr": bad, "refId": "X"})
        found = unknown_series(d, fams)
        assert len(found) == 1 and found[0].endswith(bad + " -> " + promql_metric_names(bad).pop()), found
    # rows nest panels: those are checked too
    d = copy.deepcopy(base)
    d["panels"].append({"type": "row", "title": "nested", "panels": [{"title": "inner", "targets": [
        {"expr": "hyrax_not_a_metric", "refId": "Y"}]}]})
    assert unknown_series(d, fams) == ["inner: hyrax_not_a_metric -> hyrax_not_a_metric"]


def test_label_matchers_are_not_taken_for_metric_names():
    assert promql_metric_names('sum(rate(hyrax_restores_total{result="hyrax_x"}[5m]))') == {"hyrax_restores_total"}


def test_shipped_grafana_json_is_what_build_grafana_generates():
    spec = importlib.util.spec_from_file_location("build_grafana", REPO / "dashboards" / "build_grafana.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert GRAFANA_JSON.read_text() == json.dumps(mod.build(), indent=2) + "\n", (
        "dashboards/hyrax-grafana.json is stale: run python dashboards/build_grafana.py")


GATEWAY_LOCAL = ("hyrax_time_to_first_token_seconds", "hyrax_inter_token_latency_seconds",
                 "hyrax_e2e_request_latency_seconds", "hyrax_router_")


DEPLOYMENT_WIDE = ("hyrax_deployment_events_total",)  # the controller's: the same from every gateway


def replica_queries_unaggregated(dashboard) -> list[str]:
    """Queries over replica series (exported by every gateway, so scraped once per gateway pod)
    that do not first take one series per replica (`max/min by (role, replica ...)`), and over
    the controller's series that do not first take one per label set (`max by (kind)`)."""
    bad = []
    for title, expr in grafana_exprs(dashboard):
        names = promql_metric_names(expr)
        if names & set(DEPLOYMENT_WIDE):
            if "max by (kind)" not in expr:
                bad.append(f"{title}: {expr}")
        elif any(not n.startswith(GATEWAY_LOCAL) for n in names) and "by (role, replica" not in expr:
            bad.append(f"{title}: {expr}")
    return bad


def test_replica_series_are_counted_once_with_several_gateways():
    """Two gateways each re-export every replica's counters: a dashboard sum over both pods
    would double every total unless it keeps one series per replica first."""
    assert replica_queries_unaggregated(load_grafana()) == []
    d = load_grafana()
    d["panels"][0]["targets"].append({"expr": "sum by (role) (rate(hyrax_generation_tokens_total[1m]))", "refId": "Z"})
    assert len(replica_queries_unaggregated(d)) == 1  # the check notices a plain sum
    d["panels"][0]["targets"].append({"expr": "sum by (kind) (increase(hyrax_deployment_events_total[15m]))",
                                      "refId": "Y"})
    assert len(replica_queries_unaggregated(d)) == 2  # and a sum of the controller's counts over gateways
