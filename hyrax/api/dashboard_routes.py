"""The built-in live dashboard: a static page and its assets (shipped in the package, no
CDN), plus a public JSON summary of aggregate numbers it polls. Request details and actions
go through the admin API with the token the user enters."""
from __future__ import annotations

from importlib import resources

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse, Response

from hyrax.api.errors import APIError

router = APIRouter()
_ASSETS = {"dashboard.js": "application/javascript", "dashboard.css": "text/css"}


def _read(name: str) -> str:
    return resources.files("hyrax.api").joinpath("dashboard", name).read_text(encoding="utf-8")


@router.get("/dashboard", response_class=HTMLResponse)
async def page():
    return HTMLResponse(_read("index.html"))


@router.get("/dashboard/assets/{name}")
async def asset(name: str):
    if name not in _ASSETS:
        raise APIError(404, "no such asset", param="name", code="not_found")
    return Response(_read(name), media_type=_ASSETS[name])


@router.get("/dashboard/summary")
async def summary(request: Request):
    client = request.app.state.client
    stats, pools = await client.stats(), await client.pools()
    usage: dict[str, float] = {}
    for p in pools:
        for comp, u in p["components"].items():
            usage[comp] = max(usage.get(comp, 0.0), u["used"] / u["capacity"] if u["capacity"] else 0.0)
    keep = ("role", "replica", "running", "waiting", "retracted", "generation_tokens", "prompt_tokens",
            "retractions", "restores", "restore_fallbacks", "checksum_failures")
    reps = []
    for s in stats:
        r = {k: s.get(k) for k in keep}
        r["bytes_transferred"] = sum(s.get("bytes_transferred", {}).values())
        pc = s.get("prefix_cache", {})
        r["prefix_query_tokens"], r["prefix_hit_tokens"] = pc.get("query_tokens", 0), pc.get("hit_tokens", 0)
        reps.append(r)
    ttft = request.app.state.metrics.ttft
    return {"model": client.model.name, "ready": request.app.state.ready, "replicas": reps,
            "pool_usage": usage, "ttft_p50": _p50(ttft),
            "controller": request.app.state.deployment_events is not None}  # /admin/events has a log to read


def _p50(hist) -> float | None:
    """Median from a prometheus_client Histogram's cumulative buckets (upper bound)."""
    samples = [s for m in hist.collect() for s in m.samples if s.name.endswith("_bucket")]
    total = max((s.value for s in samples), default=0)
    for s in samples:
        if total and s.value >= total / 2:
            return float(s.labels["le"]) if s.labels["le"] != "+Inf" else None
    return None
