"""Closed-loop HTTP load generator for the serving suite, run as its own process
(`python -m bench.loadgen` with a JSON job on stdin, JSON results on stdout) so that the
client's work never holds the gateway process's GIL while latencies are measured.

Each of `concurrency` workers takes the next request and streams it from
`POST /v1/completions` (prompt token ids, greedy, ignore_eos, include_usage). Per request it
records TTFT (send -> first SSE chunk with text), the gaps between text chunks (ITL), the
end-to-end latency and the number of output tokens (from `usage`).

The client is aiohttp (installed with Ray's dashboard): the load generator shares the bench
machine's two cores with the server it measures, and httpx's async client used more CPU per
streamed chunk (measured, the quick c=16 workload, 32 requests, 1,009 streamed tokens, same
stack, prefix cache off, clients alternating, 4 runs each: 0.86-0.92 s of client CPU per run,
start-up included, vs 0.58-0.65 s; throughput within the noise, 328-343 vs 301-352 tok/s).

The clients stand in for remote ones, so the process keeps off the CPUs the deployment's ranks
claimed (`keep_off_cpus` in the job, hyrax/actors/cpu_claims.py), as a client on another
machine would, and as the gateway's and coordinator's threads do. Measured on the 2-core machine
(quick c=16 workload, 5-6 runs each, alternating, same stack): with the client, gateway and
coordinator all kept off the rank's CPU the full stack made 0.94-0.98 of the in-process engine's
tok/s against 0.86-0.92 with none kept off; the client alone, or the server's threads alone,
kept off changed nothing beyond the noise.
"""
from __future__ import annotations

import asyncio
import json
import sys
import time

from hyrax.actors.cpu_claims import keep_off


async def _one(client, url: str, model: str, req: dict) -> dict:
    body = {"model": model, "prompt": req["prompt"], "max_tokens": req["max_tokens"], "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    chunks: list[tuple[float, int]] = []  # (arrival, characters of text) per chunk with text
    usage = None
    error = None
    async with client.post(f"{url}/v1/completions", json=body) as r:
        if r.status != 200:
            return {"error": f"HTTP {r.status}: {(await r.read())[:200]!r}"}
        async for raw in r.content:  # one SSE line per iteration
            if not raw.startswith(b"data: "):
                continue
            data = raw[6:].strip()
            if data == b"[DONE]":
                break
            obj = json.loads(data)
            if "error" in obj:
                error = obj["error"]
            if obj.get("usage"):
                usage = obj["usage"]
            for ch in obj.get("choices", []):
                if ch.get("text"):
                    chunks.append((time.perf_counter(), len(ch["text"])))
    t1 = time.perf_counter()
    if not chunks:
        return {"error": error or "no tokens streamed"}
    times = [t for t, _ in chunks]
    return {
        "ttft": times[0] - t0,
        "itl": [b - a for a, b in zip(times, times[1:])],
        "latency": t1 - t0,
        "tokens": usage["completion_tokens"] if usage else sum(n for _, n in chunks),
        "chunk_chars": sum(n for _, n in chunks),
        "expected": req["max_tokens"],
        "error": error,
    }


async def run(job: dict) -> dict:
    import aiohttp

    reqs = list(job["requests"])
    c = int(job["concurrency"])
    connector = aiohttp.TCPConnector(limit=c + 4)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600.0)) as client:
        for w in job.get("warmup", []):  # not timed: first requests pay one-off costs
            await _one(client, job["url"], job["model"], w)
        results: list[dict | None] = [None] * len(reqs)
        queue = list(enumerate(reqs))[::-1]

        async def worker():
            while queue:
                i, req = queue.pop()
                results[i] = await _one(client, job["url"], job["model"], req)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(min(c, len(reqs)))))
        wall = time.perf_counter() - t0
    return {"wall": wall, "results": results}


def main(run_job=None) -> int:
    """Read a JSON job on stdin, run it (`run_job`, default: this module's `run`), answer JSON."""
    job = json.load(sys.stdin)
    keep_off(set(job.get("keep_off_cpus", ())))  # before any thread starts: they inherit it
    json.dump(asyncio.run((run_job or run)(job)), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
