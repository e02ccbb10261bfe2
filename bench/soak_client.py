"""The soak suite's clients, run as their own process (`python -m bench.soak_client`, a JSON
job on stdin, JSON results on stdout), so that 10,000 HTTP exchanges never hold the gateway
process's GIL.

Three kinds of task share one event loop:

- `concurrency` workers take the next request of the job and play its client: one that stays
  to the end (streaming or not), or one that vanishes — after 0, 1, 2 or 5 streamed chunks,
  or a few milliseconds into a non-streaming call. Every call carries `X-Request-Id`.
- with `chaos`, an operator cycles through the admin API: retract-and-hold then resume all,
  retract without hold (each backup mode in turn), migrate a running decode request, drain a
  decode replica then undrain it.
- a poller lists `/admin/requests` every `poll_s` and remembers when each call's requests were
  last seen, which bounds how long a vanished client's state stayed allocated.
"""
from __future__ import annotations

import asyncio
import itertools
import json
import random
import sys
import time


def _body(job: dict, req: dict) -> dict:
    body = {"model": job["model"], "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": req["stream"]}
    if req["stream"]:
        body["stream_options"] = {"include_usage": True}
    return body


async def _stay(client, job: dict, req: dict) -> dict:
    """A client that reads its answer to the end."""
    url, headers = f"{job['url']}/v1/completions", {"X-Request-Id": req["id"]}
    if not req["stream"]:
        r = await client.post(url, json=_body(job, req), headers=headers)
        if r.status_code != 200:
            return {"status": r.status_code, "error": r.text[:300]}
        out = r.json()
        ch = out["choices"][0]
        return {"status": 200, "text": ch["text"], "finish_reason": ch["finish_reason"],
                "tokens": out["usage"]["completion_tokens"]}
    text, finish, tokens, error = [], None, None, None
    async with client.stream("POST", url, json=_body(job, req), headers=headers) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "error": (await r.aread())[:300].decode("utf-8", "replace")}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            error = obj.get("error", error)
            if obj.get("usage"):
                tokens = obj["usage"]["completion_tokens"]
            for ch in obj.get("choices", []):
                text.append(ch.get("text") or "")
                finish = ch.get("finish_reason") or finish
    return {"status": 200, "text": "".join(text), "finish_reason": finish, "tokens": tokens, "error": error}


async def _vanish(client, job: dict, req: dict) -> dict:
    """A client that goes away: after `after_chunks` SSE events, or `after_s` into a
    non-streaming call. Returns when (monotonic) it closed its connection."""
    url, headers = f"{job['url']}/v1/completions", {"X-Request-Id": req["id"]}
    if not req["stream"]:
        try:
            r = await asyncio.wait_for(client.post(url, json=_body(job, req), headers=headers), req["after_s"])
            return {"status": r.status_code, "closed": None}  # answered before the client left
        except asyncio.TimeoutError:
            return {"status": None, "closed": time.monotonic()}
    async with client.stream("POST", url, json=_body(job, req), headers=headers) as r:
        if r.status_code != 200:
            return {"status": r.status_code, "closed": None}
        seen = 0
        if req["after_chunks"]:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    seen += 1
                    if line == "data: [DONE]":
                        return {"status": 200, "closed": None}  # finished before the client left
                    if seen >= req["after_chunks"]:
                        break
    return {"status": 200, "closed": time.monotonic()}  # leaving the block closes the connection


async def _client(client, job: dict, req: dict) -> dict:
    import httpx

    try:
        res = await (_vanish if req.get("vanish") else _stay)(client, job, req)
    except httpx.HTTPError as e:
        res = {"status": None, "error": f"{type(e).__name__}: {e}"[:300]}
    res["id"] = req["id"]
    return res


class _Operator:
    """Admin actions in a cycle, one every `period_s`; records each answer's status."""

    def __init__(self, client, job: dict):
        self.client, self.job = client, job
        self.headers = {"Authorization": f"Bearer {job['admin_token']}"}
        self.statuses: dict[str, list[int]] = {}
        self.rng = random.Random(job.get("seed", 0))

    async def _post(self, what: str, path: str, body: dict):
        r = await self.client.post(f"{self.job['url']}/admin/{path}", json=body, headers=self.headers)
        self.statuses.setdefault(what, []).append(r.status_code)
        return r

    async def _running_on(self, role: str) -> list[str]:
        r = await self.client.get(f"{self.job['url']}/admin/requests", headers=self.headers)
        return [x["id"] for x in r.json()["requests"] if x["role"] == role and x["state"] == "running"]

    async def retract_hold_resume(self):
        await self._post("retract hold", "retract", {"count": 2, "mode": "host_pool", "hold": True})
        await asyncio.sleep(0.3)
        await self._post("resume all", "resume", {"all": True})

    async def retract(self, mode: str):
        await self._post(f"retract {mode}", "retract", {"count": 1, "mode": mode})

    async def migrate(self):
        running = await self._running_on("decode")
        if running:
            await self._post("migrate", "migrate", {"request_id": self.rng.choice(running)})

    async def drain(self):
        replica = self.rng.randrange(self.job["decode_replicas"])
        await self._post("drain", "drain", {"role": "decode", "replica": replica})
        await asyncio.sleep(1.0)
        await self._post("undrain", "drain", {"role": "decode", "replica": replica, "undrain": True})

    async def run(self, stop: asyncio.Event) -> None:
        actions = itertools.cycle([self.retract_hold_resume, lambda: self.retract("cpu_tensor"), self.migrate,
                                   lambda: self.retract("recompute"), self.drain,
                                   lambda: self.retract("host_pool")])
        while not stop.is_set():
            try:
                await next(actions)()
            except Exception as e:  # noqa: BLE001 - a failed admin call is counted, not fatal
                self.statuses.setdefault(f"failed: {type(e).__name__}", []).append(0)
            try:
                await asyncio.wait_for(stop.wait(), self.job["operator_period_s"])
            except asyncio.TimeoutError:
                pass


class _Listings:
    """When each call's requests were last listed by `/admin/requests`, and where. A listing
    shows the replicas' state at some moment between sending the call and its answer, so each
    sighting keeps both ends: the send time bounds how long a request stayed from below, the
    answer time from above."""

    def __init__(self, client, job: dict):
        self.client, self.job = client, job
        self.headers = {"Authorization": f"Bearer {job['admin_token']}"}
        self.seen: dict[str, tuple[float, float, str]] = {}  # call id -> (sent, answered, where)
        self.statuses: list[int] = []
        self.round_trips: list[float] = []

    async def list(self) -> list[dict]:
        sent = time.monotonic()
        r = await self.client.get(f"{self.job['url']}/admin/requests", headers=self.headers)
        answered = time.monotonic()
        self.statuses.append(r.status_code)
        self.round_trips.append(answered - sent)
        listed = r.json()["requests"] if r.status_code == 200 else []
        for x in listed:
            cid = x["id"].rsplit("-", 2)[0]  # engine id: <call id>-<choice>-<nonce>
            self.seen[cid] = (sent, answered, f"{x['role']}/{x['replica']} {x['state']}")
        return listed

    async def poll(self, stop: asyncio.Event) -> None:
        while not stop.is_set():
            await self.list()
            await asyncio.sleep(self.job["poll_s"])


async def run(job: dict) -> dict:
    import httpx

    reqs, c = job["requests"], int(job["concurrency"])
    limits = httpx.Limits(max_connections=c + 8, max_keepalive_connections=c + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:
        results: list[dict | None] = [None] * len(reqs)
        queue = list(enumerate(reqs))[::-1]
        listings = _Listings(client, job)
        stop = asyncio.Event()
        operator = _Operator(client, job)

        async def worker():
            while queue:
                i, req = queue.pop()
                results[i] = await _client(client, job, req)

        side = [asyncio.ensure_future(listings.poll(stop))]
        if job["chaos"]:
            side.append(asyncio.ensure_future(operator.run(stop)))
        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(c, len(reqs)))))
        wall = time.perf_counter() - t0
        stop.set()
        await asyncio.gather(*side)
        # the last vanished clients' requests may still be on their way out
        deadline = time.monotonic() + job["settle_s"]
        while time.monotonic() < deadline:
            listed = await listings.list()
            if not listed:
                break
            await asyncio.sleep(job["poll_s"])
    return {"wall": wall, "results": results, "seen": listings.seen, "operator": operator.statuses,
            "poll_statuses": listings.statuses, "poll_round_trips": listings.round_trips,
            "still_listed": [x["id"] for x in listed]}


if __name__ == "__main__":
    from bench.loadgen import main

    sys.exit(main(run))
