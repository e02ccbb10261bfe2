"""Helpers for the observability tests: the gateway served by uvicorn on 127.0.0.1 in a
background thread, the documented metric names (dashboards/METRICS.md), the Prometheus text
parsed into families, and the metric names a PromQL expression refers to.

Imported by the test modules and the conftest next to it (pytest puts this folder on
sys.path). The uvicorn-in-a-thread gateway comes from tests/gateway_harness.py.
"""
from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass
from pathlib import Path


from gateway_harness import HTTP, Gateway, free_port, wait_until  # noqa: F401 - re-exported

REPO = Path(__file__).resolve().parents[2]
DEMO_MODEL = str(REPO / "hyrax" / "models" / "demo")
METRICS_MD = REPO / "dashboards" / "METRICS.md"
GRAFANA_JSON = REPO / "dashboards" / "hyrax-grafana.json"
MODEL = "hyrax-demo"
ADMIN_TOKEN = "observability-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


# ---- the PD scenario (fixture pd_run) ------------------------------------------------------
FORCED_INTERVAL = 3
# (prompt, max_tokens, stream). Prompt lengths span one page, several pages, and more than
# the sliding window (64), so every component's byte formula branch is exercised. The
# max_tokens=1 request finishes on the prefill replica and is never handed off.
PD_REQUESTS = [
    ("Hello, Hyrax!", 20, False),
    ("The quick brown fox jumps over the lazy dog.", 24, True),
    ("0123456789" * 10, 18, False),
    ("def retract(request):\n    return backup(request.state)\n", 22, True),
    ("One token only, please.", 1, False),
    ("Hi", 12, False),  # shorter than the sliding window
]


@contextlib.contextmanager
def serving(client, deployment_events=None):
    """create_app(client) with the admin token, served on 127.0.0.1; yields the Gateway."""
    from hyrax.api.app import GatewaySettings, create_app

    gw = Gateway(create_app(client, GatewaySettings(admin_token=ADMIN_TOKEN), deployment_events=deployment_events))
    try:
        yield gw
    finally:
        gw.close()


def admin_get(url: str, path: str) -> dict:
    r = HTTP.get(f"{url}{path}", headers=ADMIN, timeout=30)
    assert r.status_code == 200, (path, r.status_code, r.text)
    return r.json()


def pools_clean(url: str) -> bool:
    """Every component of every replica: no device unit and no host row in use."""
    return all(c["used"] == 0 and c["host_used"] == 0
               for rep in admin_get(url, "/admin/pools")["replicas"] for c in rep["components"].values())


# ---- the documented names ------------------------------------------------------------------
SECTION_TYPES = {"gauges": "gauge", "counters": "counter", "histograms": "histogram"}


@dataclass(frozen=True)
class DocumentedMetric:
    name: str  # as it appears in the exposition's samples (counters with `_total`)
    type: str  # gauge, counter, histogram
    labels: frozenset  # documented label names (histograms: without `le`)

    @property
    def family(self) -> str:
        """The family name prometheus_client's parser reports (counters lose `_total`)."""
        return self.name[: -len("_total")] if self.type == "counter" else self.name


def documented_metrics(markdown: str) -> dict[str, DocumentedMetric]:
    """The metrics in the tables of METRICS.md, keyed by family name. The section heading
    (`## Gauges` / `## Counters` / `## Histograms`) gives the type; a row's first cell the
    name, its second the labels ("—" for none)."""
    out: dict[str, DocumentedMetric] = {}
    kind = None
    for line in markdown.splitlines():
        if line.startswith("## "):
            kind = SECTION_TYPES.get(line[3:].strip().lower())
            continue
        m = re.match(r"^\|\s*`(hyrax_[a-z0-9_]+)`\s*\|([^|]*)\|", line)
        if m is None or kind is None:
            continue
        labels = frozenset(x.strip() for x in m.group(2).split(",") if x.strip() not in ("", "—", "-"))
        d = DocumentedMetric(m.group(1), kind, labels)
        assert d.family not in out, f"{d.name} is documented twice"
        out[d.family] = d
    return out


# ---- the exposition ------------------------------------------------------------------------
def parse_families(text: str) -> dict:
    """Prometheus text -> {family name: Metric} (prometheus_client's own parser; it raises on
    anything malformed)."""
    from prometheus_client.parser import text_string_to_metric_families

    fams = {}
    for f in text_string_to_metric_families(text):
        assert f.name not in fams, f"family {f.name} appears twice in the scrape"
        fams[f.name] = f
    return fams


def value(fams: dict, sample: str, **labels) -> float:
    """Sum of the samples named `sample` whose labels include `labels` (0 when none)."""
    fam = sample
    for suffix in ("_total", "_bucket", "_count", "_sum"):
        if sample.endswith(suffix) and sample[: -len(suffix)] in fams:
            fam = sample[: -len(suffix)]
            break
    if fam not in fams:
        raise AssertionError(f"no family for {sample} in the scrape")
    want = {k: str(v) for k, v in labels.items()}
    return sum(s.value for s in fams[fam].samples
               if s.name == sample and all(s.labels.get(k) == v for k, v in want.items()))


def sample_labels(fam) -> set[frozenset]:
    """The label-name sets used by a family's samples (histograms: without `le`)."""
    return {frozenset(k for k in s.labels if k != "le") for s in fam.samples}


def missing_documented(documented: dict[str, DocumentedMetric], fams: dict) -> list[str]:
    """Documented metrics that the scrape lacks, exports as another type, exports with no
    sample, or labels differently. Empty when the scrape matches the documentation."""
    problems = []
    for fam_name, d in sorted(documented.items()):
        f = fams.get(fam_name)
        if f is None:
            problems.append(f"{d.name}: not exported")
        elif f.type != d.type:
            problems.append(f"{d.name}: exported as {f.type}, documented as {d.type}")
        elif not f.samples:
            problems.append(f"{d.name}: exported without any sample")
        elif sample_labels(f) != {d.labels}:
            problems.append(f"{d.name}: labels {sorted(map(sorted, sample_labels(f)))}, documented {sorted(d.labels)}")
    return problems


# ---- PromQL --------------------------------------------------------------------------------
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def promql_metric_names(expr: str) -> set[str]:
    """Identifiers of Hyrax series in a PromQL expression (label names and values in {...}
    are not metric names and are dropped first)."""
    expr = re.sub(r"\{[^}]*\}", "", expr)
    return set(re.findall(r"\bhyrax_[a-z0-9_]+", expr))


def family_of(series: str, fams: dict) -> str | None:
    """The exported family a series name belongs to, honouring the family's type: a counter
    is queried as `<family>_total`, a histogram as `<family>_bucket|_sum|_count`, a gauge by
    its own name. None when the scrape has no such series."""
    for fam_name, f in fams.items():
        for suffix in SUFFIXES.get(f.type, ("",)):
            if series == fam_name + suffix:
                return fam_name
    return None


def grafana_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(panel title, expr) of every target of every panel, rows' nested panels included."""
    out = []

    def walk(panels):
        for p in panels:
            for t in p.get("targets", []):
                if "expr" in t:
                    out.append((p.get("title", "?"), t["expr"]))
            walk(p.get("panels", []))

    walk(dashboard.get("panels", []))
    return out


def unknown_series(dashboard: dict, fams: dict) -> list[str]:
    """'panel: expr -> name' for every Hyrax series a Grafana expression names that the
    scrape does not export. Empty when every query can be answered."""
    bad = []
    for title, expr in grafana_exprs(dashboard):
        for name in sorted(promql_metric_names(expr)):
            if family_of(name, fams) is None:
                bad.append(f"{title}: {expr} -> {name}")
    return bad


def load_grafana() -> dict:
    return json.loads(GRAFANA_JSON.read_text())
