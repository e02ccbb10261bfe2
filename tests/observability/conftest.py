"""Observability fixtures.

`pd_run` (session): one prefill + one decode replica on Ray with forced retraction, a few
requests through the gateway, then everything the metric tests compare: the /metrics text,
the responses, the coordinators' own stats and pools. The deployment is shut down before
the tests look at the record, so no actor outlives the fixture's set-up; Ray is shut down
too when this fixture started it (other test folders share the process and may have).

`local_stack` / `local`: the gateway over an in-process engine (no Ray), for the browser tests.

`chromium`: Debian's chromium and the `playwright` package, installed by
.ci/install-browser.sh when missing; the browser tests skip, saying why, only when that
install fails.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before the first `import ray`

import asyncio  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import httpx  # noqa: E402
import pytest  # noqa: E402

from obs_harness import (  # noqa: E402
    ADMIN, DEMO_MODEL, FORCED_INTERVAL, HTTP, MODEL, PD_REQUESTS, REPO, pools_clean, serving, wait_until,
)

# ---- the PD run ----------------------------------------------------------------------------
@dataclass
class PDRun:
    metrics_text: str
    content_type: str
    responses: list[dict]  # per request: prompt_tokens, completion_tokens, finish_reason, max_tokens
    stats: dict  # (role, replica) -> the coordinator's stats()
    pools: dict  # (role, replica) -> the coordinator's pools()
    clean_after: bool  # every replica idle with empty pools, invariants held, before the scrape

    @property
    def handed_off(self) -> list[dict]:
        """Requests that lived past their first token, i.e. went from prefill to decode."""
        return [r for r in self.responses if r["max_tokens"] > 1]


async def _one(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, stream: bool) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if not stream:
        r = await http.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        j = r.json()
        usage, finish = j["usage"], j["choices"][0]["finish_reason"]
    else:
        body.update(stream=True, stream_options={"include_usage": True})
        finish, usage = None, None
        async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                ev = json.loads(line[6:])
                if ev["choices"] and ev["choices"][0]["finish_reason"]:
                    finish = ev["choices"][0]["finish_reason"]
                if ev.get("usage"):
                    usage = ev["usage"]
        assert usage is not None, "the stream carried no usage chunk"
    return {"prompt_tokens": usage["prompt_tokens"], "completion_tokens": usage["completion_tokens"],
            "finish_reason": finish, "max_tokens": max_tokens, "stream": stream}


async def _drive(url: str) -> list[dict]:
    async with httpx.AsyncClient(timeout=180) as http:
        return list(await asyncio.gather(*(_one(http, url, p, n, s) for p, n, s in PD_REQUESTS)))


@pytest.fixture(scope="session")
def pd_run() -> PDRun:
    from hyrax.cluster.ray_cluster import init_ray

    import ray

    started = False if ray.is_initialized() else init_ray(num_cpus=16, dashboard=False, num_gpus=0)
    try:
        from hyrax.actors.engine.config import EngineConfig
        from hyrax.cluster import controller
        from hyrax.cluster.deployment import RoleSpec
        from hyrax.cluster.ray_client import client_for
        from hyrax.cluster.serve import _events_of

        # as hyrax serve deploys: a controller owns the replicas, and /metrics counts its events
        ctl = controller.create("observability", DEMO_MODEL, MODEL, [RoleSpec("prefill", 1, 1), RoleSpec("decode", 1, 1)],
                                EngineConfig(forced_retraction_interval=FORCED_INTERVAL), rank_timeout_s=60,
                                attach=False)
        try:
            dep = controller.ensure(ctl, timeout_s=300)
            coords = {(r.role, r.index): r.coordinator for r in dep.replicas}
            with serving(client_for(dep, MODEL), deployment_events=_events_of(ctl)) as gw:
                responses = asyncio.run(_drive(gw.url))

                def idle():
                    return all(ray.get([c.is_idle_clean.remote() for c in coords.values()], timeout=30))

                wait_until(idle, 30, what="every replica idle with empty pools")
                clean = (all(ray.get([c.check_invariants.remote() for c in coords.values()], timeout=30))
                         and pools_clean(gw.url)
                         and not HTTP.get(f"{gw.url}/admin/requests", headers=ADMIN, timeout=30).json()["requests"])
                scrape = HTTP.get(f"{gw.url}/metrics", timeout=30)
                assert scrape.status_code == 200, scrape.text
                stats = dict(zip(coords, ray.get([c.stats.remote() for c in coords.values()], timeout=30)))
                pools = dict(zip(coords, ray.get([c.pools.remote() for c in coords.values()], timeout=30)))
        finally:
            controller.tear_down(ctl)
    finally:
        if started:
            ray.shutdown()
    return PDRun(scrape.text, scrape.headers.get("content-type", ""), responses, stats, pools, clean)


# ---- the in-process stack ------------------------------------------------------------------
@dataclass
class LocalStack:
    url: str
    loop: object  # the EngineLoop running the in-process engine


@pytest.fixture(scope="module")
def local_stack():
    """The gateway over an in-process engine (one per module)."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.engine.loop import EngineLoop
    from hyrax.api.client import EngineClient, LocalBackend
    from hyrax.cluster.ray_client import model_info

    info = model_info(DEMO_MODEL, MODEL)
    loop = EngineLoop(load_engine(DEMO_MODEL, EngineConfig(), decode=info.tokenizer.decode), "observability")
    try:
        with serving(EngineClient(info, [LocalBackend(loop)])) as gw:
            yield LocalStack(gw.url, loop)
    finally:
        loop.shutdown()


@pytest.fixture
def local(local_stack):
    """The in-process stack; after the test the engine must be idle with clean pools and
    its invariants must hold (STYLE §9)."""
    yield local_stack
    wait_until(local_stack.loop.is_idle_clean, 30, what="the engine to be idle with empty pools")
    assert local_stack.loop.check_invariants()
    assert pools_clean(local_stack.url)


# ---- the browser ---------------------------------------------------------------------------
CHROMIUM = "/usr/bin/chromium"
INSTALL_SCRIPT = REPO / ".ci" / "install-browser.sh"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _have_browser() -> bool:
    importlib.invalidate_caches()
    try:
        importlib.import_module("playwright.sync_api")
    except ImportError:
        return False
    return Path(CHROMIUM).exists()


@pytest.fixture(scope="session")
def chromium() -> str:
    """Path of Debian's chromium, with the playwright package importable; installs both with
    .ci/install-browser.sh when missing, and skips (with the installer's output) only when
    that fails."""
    if not _have_browser():
        if shutil.which("apt-get") is None:
            pytest.skip(f"{CHROMIUM} or playwright missing, and no apt-get to install them")
        try:
            p = subprocess.run(["bash", str(INSTALL_SCRIPT)], cwd=REPO, capture_output=True, text=True,
                               timeout=1200, env=dict(os.environ, PYTHON=sys.executable))
        except subprocess.TimeoutExpired:
            pytest.skip(f"{INSTALL_SCRIPT} did not finish in 20 minutes")
        if p.returncode != 0 or not _have_browser():
            pytest.skip(f"could not install chromium + playwright with {INSTALL_SCRIPT} "
                        f"(exit {p.returncode}): {(p.stdout + p.stderr)[-1500:]}")
    return CHROMIUM


@pytest.fixture
def page(chromium, tmp_path):
    """A fresh headless chromium (new user-data-dir) driven by Playwright; the page records
    console errors and uncaught exceptions in `page.errors`."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as pw:
        ctx = pw.chromium.launch_persistent_context(
            str(tmp_path / "chromium-profile"), executable_path=chromium, headless=True, args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 1000})
        try:
            pg = ctx.pages[0] if ctx.pages else ctx.new_page()
            pg.errors = []
            pg.on("console", lambda m: pg.errors.append(f"console.{m.type}: {m.text} ({m.location.get('url')})")
                  if m.type == "error" else None)
            pg.on("pageerror", lambda e: pg.errors.append(f"uncaught: {e}"))
            yield pg
        finally:
            ctx.close()
