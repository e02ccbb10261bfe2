"""Prometheus metrics (prefix `hyrax_`). Request latencies are measured at the gateway;
engine counters, gauges and histograms are gathered from every replica at scrape time.
Names and meanings: dashboards/METRICS.md."""
from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from hyrax.api.deployment_events import ControllerSilent, fetch
from hyrax.api.health import HealthReport

disable_created_metrics()  # no *_created series: they double the scrape for no dashboard use

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
RL = ["role", "replica"]


class GatewayMetrics:
    def __init__(self):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("hyrax_time_to_first_token_seconds", "Request arrival at the gateway to its first token.",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.itl = Histogram("hyrax_inter_token_latency_seconds", "Gap between consecutive streamed token batches of a request.",
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("hyrax_e2e_request_latency_seconds", "Request arrival to its last token.",
                             buckets=LATENCY_BUCKETS, registry=self.registry)

    def timer(self) -> "ChoiceTimer":
        return ChoiceTimer(self)


class ChoiceTimer:
    def __init__(self, m: GatewayMetrics):
        self.m = m
        self.start = self.last = time.monotonic()
        self.first = True

    def tokens(self, n: int) -> None:
        if n <= 0:
            return
        now = time.monotonic()
        if self.first:
            self.m.ttft.observe(now - self.start)
            self.first = False
        else:
            self.m.itl.observe((now - self.last) / n)
        self.last = now

    def done(self) -> None:
        self.m.e2e.observe(time.monotonic() - self.start)


def _hist(name: str, doc: str, series: list[tuple[list[str], dict]]) -> HistogramMetricFamily:
    fam = HistogramMetricFamily(name, doc, labels=RL)
    for labels, h in series:
        acc, buckets = 0, []
        for bound, c in zip(h["buckets"] + [float("inf")], h["counts"]):
            acc += c
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), acc))
        fam.add_metric(labels, buckets, h["sum"])
    return fam


def engine_families(stats: list[dict], pools: list[dict], health: HealthReport) -> list:
    """Metric families from per-replica stats (client.stats()) and pools (client.pools())."""
    g = {n: GaugeMetricFamily(f"hyrax_{n}", d, labels=RL) for n, d in (
        ("requests_running", "Requests running on a replica (decode or prefill in progress)."),
        ("requests_waiting", "Requests queued for admission."),
        ("requests_retracted", "Requests retracted (state backed up or to be recomputed)."),
    )}
    c = {n: CounterMetricFamily(f"hyrax_{n}", d, labels=RL + extra) for n, d, extra in (
        ("prompt_tokens", "Prompt tokens accepted.", []),
        ("generation_tokens", "Tokens generated.", []),
        ("requests_finished", "Requests finished, by finish_reason.", ["finish_reason"]),
        ("retractions", "Retractions, by trigger (memory, forced, admin) and backup mode.", ["trigger", "mode"]),
        ("restores", "Restores, by result (verified, recompute, fallback, checksum_mismatch).", ["result"]),
        ("checksum_failures", "Restores or imports whose checksums did not match.", []),
        ("state_bytes_backed_up", "Bytes of request state backed up, all ranks.", ["component"]),
        ("state_bytes_restored", "Bytes of request state restored, all ranks.", ["component"]),
        ("state_bytes_transferred", "Bytes of request state imported from another replica.", ["component"]),
        ("transfers_in", "Requests imported from another replica, by result.", ["result"]),
        ("transfers_out", "Requests handed to another replica (PD hand-off or migration).", []),
        ("offers_taken_back", "Hand-offs no other replica took, run on by the replica that offered them (a prefill "
                              "replica then decodes the request itself).", []),
        ("offers_reclaimed", "Hand-offs freed by the replica that offered them without an acknowledgement (lease "
                             "over, the gateway carrying it lost its lease, its ranks lost, or the request went on "
                             "elsewhere).", []),
        ("replica_recoveries", "Times a replica replaced failed ranks.", []),
        ("step_out_of_memory", "Steps that ran out of device memory: the batch cap was lowered and their requests "
                               "rebuilt.", []),
        ("prefix_cache_query_tokens", "Prompt tokens of requests that asked the prefix cache.", []),
        ("prefix_cache_hit_tokens", "Prompt tokens a prefix-cache hit covered (not prefilled).", []),
        ("prefix_cache_checkpoints", "Recurrent-state checkpoints handed to the prefix cache.", []),
        ("prefix_cache_corrupt_checkpoints", "Prefix-cache hits refused: a checkpoint failed its checksum.", []),
        ("prefix_cache_evicted_units", "Units (pages or checkpoint slots) evicted from the prefix cache.", ["pool"]),
    )}
    pg = {n: GaugeMetricFamily(f"hyrax_{n}", d, labels=RL + ["rank", "component"]) for n, d in (
        ("pool_usage_ratio", "Used / capacity of a device pool shard."),
        ("pool_free_units", "Units (pages or slots) of a device pool shard no request owns (the prefix cache's count: "
                            "evicted on demand)."),
        ("host_pool_usage_ratio", "Used / capacity of a host backup pool shard."),
        ("pool_cached_units", "Units of a device pool the prefix cache holds (evictable when unreferenced)."),
    )}
    up = GaugeMetricFamily("hyrax_replica_healthy", "1 when every rank of the replica answers.", labels=RL)
    hists: dict[str, list] = {}
    for s in stats:
        lab = [str(s["role"]), str(s["replica"])]
        g["requests_running"].add_metric(lab, s.get("running", 0))
        g["requests_waiting"].add_metric(lab, s.get("waiting", 0))
        g["requests_retracted"].add_metric(lab, s.get("retracted", 0))
        c["prompt_tokens"].add_metric(lab, s["prompt_tokens"])
        c["generation_tokens"].add_metric(lab, s["generation_tokens"])
        c["checksum_failures"].add_metric(lab, s["checksum_failures"])
        c["transfers_out"].add_metric(lab, s.get("transfers_out", 0))
        c["offers_taken_back"].add_metric(lab, s.get("offers_taken_back", 0))
        c["offers_reclaimed"].add_metric(lab, s.get("offers_reclaimed", 0))
        c["replica_recoveries"].add_metric(lab, s.get("recoveries", 0))
        c["step_out_of_memory"].add_metric(lab, s.get("batch_cap", {}).get("out_of_memory_steps", 0))
        for reason, n in s["finished"].items():
            c["requests_finished"].add_metric(lab + [reason], n)
        for key, n in s["retractions_by"].items():
            c["retractions"].add_metric(lab + key.split("/", 1), n)
        for result, n in s["restores_by"].items():
            c["restores"].add_metric(lab + [result], n)
        for fam, key in (("state_bytes_backed_up", "bytes_backed_up"), ("state_bytes_restored", "bytes_restored"),
                         ("state_bytes_transferred", "bytes_transferred")):
            for comp, n in s.get(key, {}).items():
                c[fam].add_metric(lab + [comp], n)
        for result, n in s.get("transfers_in", {}).items():
            c["transfers_in"].add_metric(lab + [result], n)
        pc = s.get("prefix_cache", {})
        for fam, key in (("prefix_cache_query_tokens", "query_tokens"), ("prefix_cache_hit_tokens", "hit_tokens"),
                         ("prefix_cache_checkpoints", "checkpoints"),
                         ("prefix_cache_corrupt_checkpoints", "corrupt_checkpoints")):
            c[fam].add_metric(lab, pc.get(key, 0))
        for pool, n in pc.get("evicted_units", {}).items():
            c["prefix_cache_evicted_units"].add_metric(lab + [pool], n)
        for name, h in s.get("histograms", {}).items():
            hists.setdefault(name, []).append((lab, h))
    for p in pools:
        lab = [str(p["role"]), str(p["replica"])]
        for rank in range(int(p.get("tp_size", 1))):
            for comp, u in p["components"].items():
                l2 = lab + [str(rank), comp]
                pg["pool_usage_ratio"].add_metric(l2, u["used"] / u["capacity"] if u["capacity"] else 0.0)
                pg["pool_free_units"].add_metric(l2, u["capacity"] - u["used"])
                pg["pool_cached_units"].add_metric(l2, u.get("cached", 0))
                hc = u.get("host_capacity", 0)
                pg["host_pool_usage_ratio"].add_metric(l2, u.get("host_used", 0) / hc if hc else 0.0)
    for r in health.replicas:
        up.add_metric([r.role, str(r.replica)], 1.0 if r.answer.get("healthy") else 0.0)
    docs = {"backup_duration_seconds": "Time to back up a retracted request on all ranks.",
            "restore_duration_seconds": "Time to restore and verify a request on all ranks.",
            "pd_transfer_duration_seconds": "Time to export (source side) or import and verify (target side) a request.",
            "queue_time_seconds": "Time from arrival at a replica to first scheduling."}
    out = list(g.values()) + list(c.values()) + list(pg.values()) + [up]
    for name, series in hists.items():
        out.append(_hist(f"hyrax_{name}", docs.get(name, name), series))
    return out


class _Snapshot:
    def __init__(self, families):
        self.families = families

    def collect(self):
        return self.families


def route_families(route) -> list:
    """The gateway's cache-aware routing (cache_routing.RouteStats)."""
    d = CounterMetricFamily("hyrax_router_decisions", "First-hop routing decisions among several replicas: cache "
                            "(longest cached prefix), load (no replica had a hit), margin (the hit was too busy).",
                            labels=["decision"])
    for decision in ("cache", "load", "margin"):
        d.add_metric([decision], route.decisions.get(decision, 0))
    hit = CounterMetricFamily("hyrax_router_cached_prefix_tokens", "Cached prompt tokens on the replicas chosen "
                              "(routed) and the longest on any candidate (best).", labels=["which"])
    hit.add_metric(["routed"], route.routed_hit_tokens)
    hit.add_metric(["best"], route.best_hit_tokens)
    refused = CounterMetricFamily("hyrax_router_refusals", "Requests (or hand-offs) a replica refused at admission "
                                  "(its loop closed, its actor gone): rerouted to another replica, or answered "
                                  "(503: no other replica left).", labels=["outcome"])
    for outcome in ("rerouted", "answered"):
        refused.add_metric([outcome], route.refusals.get(outcome, 0))
    return [d, hit, refused]


def event_families(page) -> list:
    """The deployment controller's events by kind since it started (hyrax/cluster/event_log.py)."""
    fam = CounterMetricFamily("hyrax_deployment_events", "Events of the deployment controller since it started: "
                              "replicas it stopped (dead, hung, down), replacements placed or failed, autoscaler "
                              "steps, its own restart.", labels=["kind"])
    for kind, n in page.counts:
        fam.add_metric([kind], n)
    return [fam]


async def _events(source) -> list:
    """`event_families` of the controller's page; none when there is no controller or it does not
    answer in time (the scrape goes on without them, as it does without a replica that is gone)."""
    if source is None:
        return []
    try:
        return event_families(await fetch(source))
    except ControllerSilent:
        return []


async def render(client, gateway: GatewayMetrics, deployment_events=None) -> bytes:
    stats, pools, health = await client.stats(), await client.pools(), await client.health()
    reg = CollectorRegistry()
    reg.register(_Snapshot(engine_families(stats, pools, health) + route_families(client.route_stats)
                           + await _events(deployment_events)))
    return generate_latest(gateway.registry) + generate_latest(reg)
