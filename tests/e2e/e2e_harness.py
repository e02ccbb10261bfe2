"""Helpers for the end-to-end tests: a gateway served by uvicorn on 127.0.0.1 in a
background thread, a transparent engine-client wrapper that records the token ids of every
request, SSE parsing, the OpenAI error-shape check, and the scenarios that run over both
the in-process engine and the Ray-backed client.

Imported by the test modules next to it (pytest puts this folder on sys.path).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import socket
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from gateway_harness import HTTP, Gateway, free_port, wait_until  # noqa: F401 - re-exported to the e2e tests
from hyrax.actors.engine.config import EngineConfig

DEMO_MODEL = str(Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo")
MODEL = "hyrax-demo"
ADMIN_TOKEN = "e2e-admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
# deterministic: greedy outputs must not depend on which requests share a batch, which is
# what lets a stream that was retracted be compared with one that was not.
# mamba_slots=12 < 32 streams: requests wait for slots, so a held request's slot is reused
# by another and its restore lands in different indices.
E2E_CONFIG = EngineConfig(deterministic=True, mamba_slots=12)


def group_alive(pgid: int) -> bool:
    """Whether any process of the process group `pgid` still runs."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def port_is_free(port: int) -> bool:
    """Nothing listens on 127.0.0.1:`port`. With SO_REUSEADDR, as a server binds: connections
    the server closed linger in TIME_WAIT for a minute and are not a listener."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


# ---- the gateway ---------------------------------------------------------------------------
class RecordingClient:
    """The engine client, passed through unchanged, remembering each request's prompt and
    token ids (the text of the random demo model loses bytes to U+FFFD, token ids do not)."""

    def __init__(self, inner):
        self._inner = inner
        self.requests: dict[str, dict] = {}

    def __getattr__(self, name):
        return getattr(self._inner, name)

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict):
        rec = {"prompt": tuple(prompt_ids), "tokens": [], "finish_reason": None}
        self.requests[request_id] = rec
        async for item in self._inner.generate(request_id, prompt_ids, params):
            rec["tokens"].extend(item.get("token_ids", []))
            if item.get("finished"):
                rec["finish_reason"] = item.get("finish_reason")
            yield item


@dataclass
class LocalStack:
    url: str
    app: object
    client: RecordingClient  # what the gateway talks to: the EngineClient, recorded
    loop: object  # the EngineLoop running the in-process engine
    engine: object

    def is_idle(self) -> bool:
        return self.loop.is_idle_clean()


@contextlib.contextmanager
def local_gateway(config: EngineConfig, **settings):
    """The gateway over an in-process engine (one rank, no Ray)."""
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.engine.loop import EngineLoop
    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.api.client import EngineClient, LocalBackend
    from hyrax.cluster.ray_client import model_info

    info = model_info(DEMO_MODEL, MODEL)
    engine = load_engine(DEMO_MODEL, config, decode=info.tokenizer.decode)
    loop = EngineLoop(engine, "e2e")
    client = RecordingClient(EngineClient(info, [LocalBackend(loop)]))
    settings.setdefault("admin_token", ADMIN_TOKEN)
    app = create_app(client, GatewaySettings(**settings))
    gw = Gateway(app)
    try:
        yield LocalStack(gw.url, app, client, loop, engine)
    finally:
        gw.close()
        loop.shutdown()


# ---- HTTP helpers --------------------------------------------------------------------------
def routes(app) -> list[tuple[str, str]]:
    """(METHOD, path) of every documented route of the gateway app."""
    return sorted((m.upper(), p) for p, ops in app.openapi()["paths"].items() for m in ops)


def assert_error(resp: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    """OpenAI's error shape, the right status, and no server internals in the body."""
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"], err
    assert isinstance(err["type"], str) and err["type"], err
    for leak in ("Traceback", 'File "', "site-packages", "/hyrax/"):
        assert leak not in resp.text, resp.text
    if code is not None:
        assert err["code"] == code, err
    if param is not None:
        assert err["param"] == param, err
    return err


def sse_data(lines) -> list:
    """The JSON payloads of an SSE stream, up to and including the "[DONE]" marker."""
    out = []
    for line in lines:
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            out.append("[DONE]")
            break
        out.append(json.loads(data))
    return out


def admin_requests(url: str) -> list[dict]:
    r = HTTP.get(f"{url}/admin/requests", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["requests"]


def admin_pools_clean(url: str) -> bool:
    r = HTTP.get(f"{url}/admin/pools", headers=ADMIN, timeout=30)
    assert r.status_code == 200, r.text
    return all(c["used"] == 0 and c["host_used"] == 0
               for rep in r.json()["replicas"] for c in rep["components"].values())


def gateway_is_idle(url: str) -> bool:
    return not admin_requests(url) and admin_pools_clean(url)


# ---- scenario: concurrent streams while the admin API retracts -----------------------------
PROMPTS = [
    "The quick brown fox jumps over the lazy dog.",
    "Hello, Hyrax!",
    "0123456789" * 7,  # crosses 16-token page boundaries
    "def retract(request):\n    return backup(request.state)\n" * 2,
]
STREAM_MAX_TOKENS = 28
# (mode, hold), taken in turn so every kind of retraction happens in every run
RETRACTIONS = [("cpu_tensor", False), ("host_pool", True), ("host_pool", False), ("cpu_tensor", True)]


def reference_outputs(url: str, client: RecordingClient, max_tokens: int = STREAM_MAX_TOKENS) -> dict:
    """Greedy output of each prompt run alone, without retraction:
    prompt -> (token ids, text, prompt token ids)."""
    out = {}
    for p in PROMPTS:
        r = HTTP.post(f"{url}/v1/completions", timeout=120, json={
            "model": MODEL, "prompt": p, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True})
        assert r.status_code == 200, r.text
        rec = client.requests[_newest(client)]
        assert len(rec["tokens"]) == max_tokens
        out[p] = (list(rec["tokens"]), r.json()["choices"][0]["text"], rec["prompt"])
    return out


def _newest(client: RecordingClient) -> str:
    return next(reversed(client.requests))


async def _stream(http: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        lines = [line async for line in r.aiter_lines()]
    events = sse_data(lines)
    assert events and events[-1] == "[DONE]", lines[-3:]
    chunks = [e for e in events[:-1] if e["choices"]]
    usage = [e["usage"] for e in events[:-1] if not e["choices"]]
    return {"prompt": prompt, "text": "".join(c["choices"][0]["text"] for c in chunks),
            "finish_reason": chunks[-1]["choices"][0]["finish_reason"], "usage": usage}


async def _retract_randomly(http: httpx.AsyncClient, url: str, done: asyncio.Event, rng: random.Random) -> Counter:
    """Until `done`: retract 1-4 random running requests per round (modes and hold in turn),
    and resume the held ones in the following round."""
    seen: Counter = Counter()
    held: list[str] = []
    turn = 0
    while not done.is_set() or held:
        if held:
            r = await http.post(f"{url}/admin/resume", headers=ADMIN, json={"request_ids": held})
            assert r.status_code == 200, r.text
            assert all(not str(v).startswith("error") for v in r.json()["results"].values()), r.json()
            seen["resumed"] += len(held)
            held = []
            continue
        r = await http.get(f"{url}/admin/requests", headers=ADMIN)
        assert r.status_code == 200, r.text
        # each id once: a request in the middle of a hand-off is listed by both replicas, and an
        # id named twice is refused
        running = list(dict.fromkeys(q["id"] for q in r.json()["requests"] if q["state"] == "running"))
        if running:
            mode, hold = RETRACTIONS[turn % len(RETRACTIONS)]
            victims = rng.sample(running, min(len(running), rng.randint(1, 4)))
            r = await http.post(f"{url}/admin/retract", headers=ADMIN,
                                json={"request_ids": victims, "mode": mode, "hold": hold})
            if r.status_code == 404:  # every victim finished since the listing: none is known any more
                assert r.json()["error"]["code"] == "request_not_found", r.text
                continue
            assert r.status_code == 200, r.text
            res = r.json()
            for rid in res["retracted"]:
                seen[res["results"][rid]] += 1
            if hold:
                held = list(res["retracted"])
                seen["held"] += len(held)
            if res["retracted"]:
                turn += 1
        await asyncio.sleep(rng.uniform(0.0, 0.02))
    return seen


async def streams_under_retraction(url: str, n_streams: int, seed: int,
                                   max_tokens: int = STREAM_MAX_TOKENS) -> tuple[list[dict], Counter]:
    rng = random.Random(seed)
    done = asyncio.Event()
    limits = httpx.Limits(max_connections=n_streams + 8, max_keepalive_connections=n_streams + 8)
    async with httpx.AsyncClient(timeout=180, limits=limits) as http:
        streams = asyncio.ensure_future(asyncio.gather(
            *(_stream(http, url, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(n_streams))))
        streams.add_done_callback(lambda _: done.set())
        chaos = asyncio.ensure_future(_retract_randomly(http, url, done, rng))
        try:
            # a failing admin loop ends the run at once (held streams would wait forever)
            await asyncio.wait({streams, chaos}, return_when=asyncio.FIRST_EXCEPTION)
            if chaos.done() and chaos.exception() is not None:
                chaos.result()
            return await streams, await chaos
        finally:
            for t in (streams, chaos):
                t.cancel()


def check_streams_match_reference(results: list[dict], ref: dict, client: RecordingClient, since: int,
                                  max_tokens: int = STREAM_MAX_TOKENS) -> None:
    for res in results:
        tokens, text, _ = ref[res["prompt"]]
        assert res["finish_reason"] == "length", res
        assert res["usage"] and res["usage"][0]["completion_tokens"] == max_tokens, res
        assert res["text"] == text, (res["prompt"], res["text"], text)
    by_prompt = {r[2]: r[0] for r in ref.values()}
    recorded = list(client.requests.values())[since:]
    assert len(recorded) == len(results)
    for rec in recorded:
        assert rec["tokens"] == by_prompt[rec["prompt"]], "a retracted stream's tokens differ from the reference"


# ---- scenario: the client goes away mid-stream ---------------------------------------------
DISCONNECT_MAX_TOKENS = 1000  # far more than is generated before the disconnect is noticed


def disconnect_mid_stream(url: str, path: str, n: int, chunks: int = 3) -> None:
    """Open a streaming request with `n` choices, read a few events, check the engine runs
    it, then drop the connection."""
    body = {"model": MODEL, "max_tokens": DISCONNECT_MAX_TOKENS, "temperature": 0, "ignore_eos": True,
            "stream": True, "n": n}
    if path == "/v1/completions":
        body["prompt"] = "Tell me everything."
    else:
        body["messages"] = [{"role": "user", "content": "Tell me everything."}]
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}{path}", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept referenced: dropping a half-read iterator closes the connection
            seen = 0
            while seen < chunks:
                seen += next(lines).startswith("data: ")
            live = [q for q in admin_requests(url) if q["state"] in ("running", "waiting")]
            assert len(live) == n, live
        # leaving the block closes the connection with the body unread


def finished_count(stats: dict, reason: str) -> int:
    return stats.get("finished", {}).get(reason, 0)


def admin_retractions(stats: dict, mode: str) -> int:
    return stats.get("retractions_by", {}).get(f"admin/{mode}", 0)
