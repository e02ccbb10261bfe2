"""Generates hyrax-grafana.json (Grafana 10+, Prometheus datasource variable).

Run `python dashboards/build_grafana.py` after changing panels; a test checks that every
PromQL expression names only metrics that /metrics exports, and k8s/ ships this file as
a ConfigMap.
"""
from __future__ import annotations

import json
from pathlib import Path

DS = {"type": "prometheus", "uid": "${datasource}"}


def q(expr: str, legend: str) -> dict:
    return {"datasource": DS, "expr": expr, "legendFormat": legend, "refId": legend[:20] or "A"}


def panel(pid: int, title: str, targets: list[dict], x: int, y: int, unit: str = "short", w: int = 12,
          overrides: list | None = None) -> dict:
    return {
        "id": pid, "type": "timeseries", "title": title, "datasource": DS,
        "gridPos": {"x": x, "y": y, "w": w, "h": 8},
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": overrides or []},
        "targets": targets,
    }


def red(name_regex: str) -> dict:
    return {"matcher": {"id": "byRegexp", "options": name_regex},
            "properties": [{"id": "color", "value": {"mode": "fixed", "fixedColor": "red"}}]}


def pct(metric: str, p: float, by: str = "") -> str:
    """A gateway's own latency histogram: every gateway's observations are summed."""
    grp = f"le{', ' + by if by else ''}"
    return f"histogram_quantile({p}, sum by ({grp}) (rate({metric}_bucket[5m])))"


def one(expr: str, labels: str = "") -> str:
    """A replica's series, once: every gateway exports every replica's counters and gauges (they
    are read from the replicas at scrape time), so with several gateways each series is scraped
    once per gateway pod; take one per replica before summing."""
    return f"max by (role, replica{', ' + labels if labels else ''}) ({expr})"


def deployment_wide(expr: str, labels: str) -> str:
    """A series about the whole deployment (the controller's events), once: every gateway asks
    the same controller and exports the same counts."""
    return f"max by ({labels}) ({expr})"


def replica_pct(metric: str, p: float) -> str:
    """A replica's histogram, once per replica (see `one`), then the quantile over replicas."""
    return f"histogram_quantile({p}, sum by (le) ({one(f'rate({metric}_bucket[5m])', 'le')}))"


def build() -> dict:
    panels = [
        panel(1, "Throughput (tokens/s)", [
            q(f"sum by (role) ({one('rate(hyrax_generation_tokens_total[1m])')})", "generated {{role}}"),
            q(f"sum by (role) ({one('rate(hyrax_prompt_tokens_total[1m])')})", "prompt {{role}}"),
        ], 0, 0, "short"),
        panel(2, "Latency percentiles", [
            q(pct("hyrax_time_to_first_token_seconds", 0.5), "TTFT p50"),
            q(pct("hyrax_time_to_first_token_seconds", 0.99), "TTFT p99"),
            q(pct("hyrax_inter_token_latency_seconds", 0.5), "ITL p50"),
            q(pct("hyrax_inter_token_latency_seconds", 0.99), "ITL p99"),
            q(pct("hyrax_e2e_request_latency_seconds", 0.99), "E2E p99"),
        ], 12, 0, "s"),
        panel(3, "Queue", [
            q(f"sum by (role) ({one('hyrax_requests_running')})", "running {{role}}"),
            q(f"sum by (role) ({one('hyrax_requests_waiting')})", "waiting {{role}}"),
            q(f"sum by (role) ({one('hyrax_requests_retracted')})", "retracted {{role}}"),
            q(replica_pct("hyrax_queue_time_seconds", 0.99), "queue time p99 (s)"),
        ], 0, 8),
        panel(4, "Pool usage per rank and component", [
            q(one("hyrax_pool_usage_ratio", "rank, component"), "{{role}}/{{replica}} r{{rank}} {{component}}"),
            q(one("hyrax_host_pool_usage_ratio", "rank, component"), "host {{role}}/{{replica}} r{{rank}} {{component}}"),
        ], 12, 8, "percentunit"),
        panel(5, "Retractions and restores (per s)", [
            q(f"sum by (trigger, mode) ({one('rate(hyrax_retractions_total[5m])', 'trigger, mode')})", "retract {{trigger}}/{{mode}}"),
            q(f"sum by (result) ({one('rate(hyrax_restores_total[5m])', 'result')})", "restore {{result}}"),
            q(f"sum ({one('rate(hyrax_checksum_failures_total[5m])')})", "checksum failures"),
        ], 0, 16, "short", overrides=[red(".*(fallback|checksum).*")]),
        panel(6, "Backup / restore duration", [
            q(replica_pct("hyrax_backup_duration_seconds", 0.99), "backup p99"),
            q(replica_pct("hyrax_restore_duration_seconds", 0.99), "restore p99"),
            q(f"sum by (component) ({one('rate(hyrax_state_bytes_backed_up_total[5m])', 'component')})", "backed up B/s {{component}}"),
        ], 12, 16, "s"),
        panel(7, "PD transfer and migration", [
            q(f"sum by (component) ({one('rate(hyrax_state_bytes_transferred_total[5m])', 'component')})", "bytes/s {{component}}"),
            q(f"sum by (result) ({one('rate(hyrax_transfers_in_total[5m])', 'result')})", "imports {{result}}"),
            q(f"sum ({one('rate(hyrax_transfers_out_total[5m])')})", "hand-offs"),
        ], 0, 24, "Bps", overrides=[red(".*(fallback|checksum).*")]),
        panel(8, "PD transfer duration", [
            q(replica_pct("hyrax_pd_transfer_duration_seconds", 0.5), "p50"),
            q(replica_pct("hyrax_pd_transfer_duration_seconds", 0.99), "p99"),
        ], 12, 24, "s"),
        panel(9, "Finished requests and replica health", [
            q(f"sum by (finish_reason) ({one('rate(hyrax_requests_finished_total[5m])', 'finish_reason')})", "finished {{finish_reason}}"),
            q("min by (role, replica) (hyrax_replica_healthy)", "healthy {{role}}/{{replica}}"),
            q(f"sum ({one('increase(hyrax_replica_recoveries_total[15m])')})", "recoveries (15m)"),
            q(deployment_wide("increase(hyrax_deployment_events_total[15m])", "kind") + " > 0", "{{kind}} (15m)"),
        ], 0, 32, "short", w=24),
        panel(10, "Prefix cache hit rate (prompt tokens)", [
            q(one("rate(hyrax_prefix_cache_hit_tokens_total[5m])") + " / "
              + one("rate(hyrax_prefix_cache_query_tokens_total[5m])"), "{{role}}/{{replica}}"),
        ], 0, 40, "percentunit"),
        panel(11, "Prefix cache units and evictions", [
            q(f"sum by (component) ({one('hyrax_pool_cached_units', 'rank, component')})", "cached {{component}}"),
            q(f"sum by (pool) ({one('rate(hyrax_prefix_cache_evicted_units_total[5m])', 'pool')})", "evicted/s {{pool}}"),
            q(f"sum ({one('rate(hyrax_prefix_cache_corrupt_checkpoints_total[5m])')})", "corrupt checkpoints/s"),
        ], 12, 40, "short", overrides=[red(".*corrupt.*")]),
    ]
    return {
        "title": "Hyrax", "uid": "hyrax-overview", "schemaVersion": 39, "version": 1,
        "time": {"from": "now-1h", "to": "now"}, "refresh": "10s", "tags": ["hyrax"],
        "templating": {"list": [{"name": "datasource", "type": "datasource", "query": "prometheus",
                                 "label": "Prometheus", "current": {}}]},
        "panels": panels,
    }


def main() -> None:
    text = json.dumps(build(), indent=2) + "\n"
    here = Path(__file__).resolve().parent
    # kustomize reads files only under its own folder, so k8s/ keeps a generated twin;
    # both are written here, from one source (a test checks they are byte-identical)
    for out in (here / "hyrax-grafana.json", here.parent / "k8s" / "monitoring" / "dashboards" / "hyrax-grafana.json"):
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")


if __name__ == "__main__":
    main()
