"""The built-in live dashboard (GET /dashboard) in a real headless chromium, driven by
Playwright, against a live gateway while long requests stream: it loads without console
errors, its charts draw points, and with the admin token it lists the running requests and
its buttons retract and resume one of them (checked through the admin API)."""
from __future__ import annotations

import json
import threading

import pytest

from obs_harness import ADMIN, ADMIN_TOKEN, DEMO_MODEL, HTTP, MODEL, admin_get, pools_clean, serving, wait_until

CHARTS = ("c-throughput", "c-queue", "c-pools", "c-retract", "c-transfer", "c-ttft", "c-prefix")
PROMPTS = ["The quick brown fox jumps over the lazy dog.", "Hello, Hyrax!", "0123456789" * 5, "Tell me more."]
MAX_TOKENS = 300


def _errors(page) -> list[str]:
    return list(page.errors)


class Streams:
    """Streaming completions of MAX_TOKENS tokens from background threads, one after another
    per thread until `stop()`, so some request is always running while the page is used."""

    def __init__(self, url: str, prompts: list[str]):
        self.url, self.done = url, threading.Event()
        self.results: list[dict] = []
        self.current: dict[int, dict] = {}  # thread -> the stream it is reading
        self.threads = [threading.Thread(target=self._run, args=(p,), daemon=True) for p in prompts]
        for t in self.threads:
            t.start()

    def _run(self, prompt: str) -> None:
        while not self.done.is_set():
            self.results.append(self._one(prompt))

    def _one(self, prompt: str) -> dict:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
        rec = {"prompt": prompt, "finish_reason": None, "usage": None, "error": None, "events": 0}
        self.current[threading.get_ident()] = rec
        try:
            with HTTP.stream("POST", f"{self.url}/v1/completions", json=body, timeout=180) as r:
                if r.status_code != 200:
                    rec["error"] = f"{r.status_code}: {r.read()!r}"
                    return rec
                for line in r.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    ev = json.loads(line[6:])
                    rec["events"] += 1
                    if ev["choices"] and ev["choices"][0]["finish_reason"]:
                        rec["finish_reason"] = ev["choices"][0]["finish_reason"]
                    if ev.get("usage"):
                        rec["usage"] = ev["usage"]
        except Exception as e:  # noqa: BLE001 - reported by the test's assertion
            rec["error"] = repr(e)
        return rec

    def stop(self, timeout: float = 120) -> list[dict]:
        """Let every thread finish its current stream; the results of all of them."""
        self.done.set()
        for t in self.threads:
            t.join(timeout=timeout)
        stuck = [self.current.get(t.ident) for t in self.threads if t.is_alive()]
        assert not stuck, f"streams still open after {timeout}s: {stuck}; engine: {_requests(self.url)}"
        return self.results


def _requests(url: str) -> dict[str, dict]:
    return {q["id"]: q for q in admin_get(url, "/admin/requests")["requests"]}


def _table(page) -> dict[str, str]:
    """id -> state as the table shows them (read in one go: the page rebuilds it every poll)."""
    return page.evaluate("""() => Object.fromEntries([...document.querySelectorAll('#requests tbody tr')]
        .map(tr => [tr.cells[0].textContent, tr.cells[1].textContent]))""")


def _retract_one_from_the_table(page, url: str, attempts: int = 5) -> str:
    """Click the retract button of the running request furthest from its end; if it ends
    before the click lands (the streams are fast), try the next one. Returns its id."""
    for _ in range(attempts):
        page.wait_for_selector('#requests tbody button[data-action="retract"]', timeout=10_000)
        running = {k: q for k, q in _requests(url).items() if q["state"] == "running"}
        if not running:
            continue
        rid = min(running, key=lambda k: running[k]["output_tokens"])
        row = page.locator("#requests tbody tr", has=page.locator(f'button[data-id="{rid}"]'))
        try:
            row.locator('button[data-action="retract"]').click(timeout=3_000)
        except Exception:  # noqa: BLE001 - the row went away: the request finished first
            continue

        def settled():
            q = _requests(url).get(rid)
            return "gone" if q is None else (q["state"] if q["state"] == "retracted" else None)

        if wait_until(settled, 10, what=f"{rid} to be retracted or finished") == "retracted":
            return rid
    raise AssertionError(f"no running request could be retracted from the table in {attempts} attempts")


def test_dashboard_charts_lists_and_retracts_a_streaming_request(local, page, tmp_path):
    url = local.url
    streams = Streams(url, PROMPTS)
    rid = None
    try:
        wait_until(lambda: any(q["state"] == "running" for q in _requests(url).values()), 30,
                   what="a streaming request to run")

        # the page loads while requests stream; the public summary needs no token
        page.goto(f"{url}/dashboard", wait_until="load")
        page.wait_for_function("document.getElementById('health').textContent === 'ready'", timeout=10_000)
        assert page.text_content("#model") == MODEL

        # with the admin token, the table lists the running requests with their actions
        page.fill("#token", ADMIN_TOKEN)
        page.dispatch_event("#token", "change")
        page.wait_for_selector('#requests tbody button[data-action="retract"]', timeout=10_000)
        assert not page.is_visible("#table-hint")
        listed = _table(page)
        assert "running" in listed.values(), listed

        # a row's retract button retracts and holds that request
        rid = _retract_one_from_the_table(page, url)
        state = _requests(url)[rid]
        assert state["hold"] is True and state["retractions"] >= 1, state
        resume = page.locator(f'#requests tbody button[data-action="resume"][data-id="{rid}"]')
        resume.wait_for(timeout=5_000)
        assert rid in page.text_content("#status")
        page.wait_for_function(f"""() => [...document.querySelectorAll('#requests tbody tr')]
            .some(tr => tr.cells[0].textContent === {json.dumps(rid)} && tr.cells[1].textContent === 'retracted')""",
                               timeout=5_000)

        # the charts draw points (one per poll and series; rates from the 2nd poll): wait for
        # three polls' worth, so the screenshot shows lines rather than single points
        page.wait_for_function(
            f"{json.dumps(CHARTS)}.every(id => Number(document.getElementById(id).dataset.points || 0) >= 3)",
            timeout=10_000)
        points = {c: int(page.get_attribute(f"#{c}", "data-points")) for c in CHARTS}
        assert all(n > 0 for n in points.values()), points
        shot = tmp_path / "dashboard.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 10_000
        print(f"dashboard screenshot: {shot}")

        # a held request stays retracted while the others stream on
        assert _requests(url)[rid]["state"] == "retracted"
        streams.done.set()  # no new streams from here on

        # its resume button brings it back; then every stream finishes in full
        resume.click()
        wait_until(lambda: _requests(url).get(rid, {}).get("state") != "retracted", 10, what=f"{rid} to resume")
    finally:
        streams.done.set()
        if rid is not None and _requests(url).get(rid, {}).get("state") == "retracted":
            HTTP.post(f"{url}/admin/resume", headers=ADMIN, json={"request_ids": [rid]}, timeout=30)  # test failed
        results = streams.stop()
    assert results
    for rec in results:
        assert rec["error"] is None, rec
        assert rec["finish_reason"] == "length", rec
        assert rec["usage"]["completion_tokens"] == MAX_TOKENS, rec
    wait_until(lambda: not _requests(url), 10, what="the request table to empty")
    wait_until(local.loop.is_idle_clean, 10, what="the engine to be idle with empty pools")
    assert pools_clean(url) and local.loop.check_invariants()
    page.wait_for_timeout(1500)  # one more poll of an idle server
    assert _errors(page) == []


def test_dashboard_page_loads_without_any_console_error(local, page):
    page.goto(f"{local.url}/dashboard", wait_until="load")
    page.wait_for_function("Number(document.getElementById('c-queue').dataset.points || 0) >= 2", timeout=10_000)
    assert _errors(page) == []


def test_dashboard_shows_the_deployment_controllers_events_newest_first(local, page):
    """Where a controller runs the deployment, the page lists its events (GET /admin/events) with
    the admin token, newest first, replicas it stopped marked; without one (the in-process
    gateway above) the section stays hidden and nothing asks for the log. The log here is the
    controller's own EventLog, read without Ray."""
    from hyrax.api.client import EngineClient, LocalBackend
    from hyrax.cluster.event_log import EventLog
    from hyrax.cluster.ray_client import model_info

    log = EventLog()
    log.add("down", "down colocated/0: its ranks could not be restarted; stopped")
    log.add("replaced", "replaced a lost colocated replica with colocated/1")

    async def events():
        return log.page()

    page.goto(f"{local.url}/dashboard", wait_until="load")  # no controller: hidden
    page.wait_for_function("Number(document.getElementById('c-queue').dataset.points || 0) >= 2", timeout=10_000)
    assert page.is_hidden("#events-section")

    with serving(EngineClient(model_info(DEMO_MODEL, MODEL), [LocalBackend(local.loop)]), deployment_events=events) as gw:
        page.goto(f"{gw.url}/dashboard", wait_until="load")
        page.wait_for_selector("#events-section", state="visible", timeout=10_000)
        page.fill("#token", ADMIN_TOKEN)
        page.dispatch_event("#token", "change")
        page.wait_for_function("document.querySelectorAll('#events tbody tr').length === 2", timeout=10_000)
        rows = page.evaluate("""() => [...document.querySelectorAll('#events tbody tr')]
            .map(tr => [tr.cells[1].textContent, tr.cells[1].className, tr.cells[2].textContent])""")
        assert rows == [["replaced", "", "replaced a lost colocated replica with colocated/1"],
                        ["down", "bad", "down colocated/0: its ranks could not be restarted; stopped"]], rows
        assert page.is_hidden("#events-hint")
    assert _errors(page) == []
