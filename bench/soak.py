"""Suite 6 — soak: thousands of requests over HTTP while everything that can go wrong does.

Hyrax: the gateway over a Ray deployment in `hyrax serve`'s shape with a second decode
replica (prefill x1, decode x2, TP=1, overlap on, deterministic kernels) on the demo
checkpoint. Clients (bench/soak_client.py, their own process) run a seeded workload in a closed
loop. The same deployment serves two runs:

- baseline: the requests whose clients stay (streaming or not), nothing else going on;
- chaos: the same requests interleaved with clients that vanish (after 0, 1, 2 or 5 streamed
  chunks, or a few milliseconds into a non-streaming call), forced retraction every 3 steps on
  every replica, and an operator cycling through retract-and-hold/resume-all, retraction in
  each backup mode, migrations and drains of a decode replica.

After each run every replica must come back to its baseline: no request listed, no pool index
or host-pool slot used, no backup held on any rank, allocation invariants intact.

Rows (all of the first four must be 0): requests lost (a staying client without its complete
answer, or a vanished client's request still listed after the run settled), pool units leaked,
5xx answers (clients, operator and poller alike), completed outputs that differ from the
baseline run; then goodput under chaos as a ratio of the baseline's (output tokens of the
staying requests per second), and the longest time a vanished client's request stayed listed
after the client closed its connection (resolution: the poll interval).
"""
from __future__ import annotations

import dataclasses
import random

from bench.common import BENCH_SEED, Profile, demo_model_dir, progress, prompt_ids
from bench.report import Row, ratio
from bench.stack import GatewayStack, serve_defaults

MODEL_NAME = "hyrax-demo"
DECODE_REPLICAS = 2
POLL_S = 0.1
VANISH_KINDS = ({"stream": True, "after_chunks": 0}, {"stream": True, "after_chunks": 1},
                {"stream": True, "after_chunks": 2}, {"stream": True, "after_chunks": 5}, {"stream": False})


def workload(profile: Profile) -> list[dict]:
    """`soak_requests` requests; a `soak_vanish_share` of them are clients that vanish."""
    rng = random.Random(BENCH_SEED + 6)
    out = []
    for i in range(profile.soak_requests):
        if rng.random() < profile.soak_vanish_share:
            kind = dict(rng.choice(VANISH_KINDS))
            if not kind["stream"]:
                kind["after_s"] = rng.uniform(0.005, 0.1)
            out.append({"prompt": prompt_ids(rng, rng.randint(8, 48)), "max_tokens": 48, "vanish": True, **kind})
        else:
            out.append({"prompt": prompt_ids(rng, rng.randint(8, 64)), "max_tokens": rng.randint(4, 16),
                        "stream": rng.random() < 0.5, "vanish": False})
    return out


def _with_ids(reqs: list[dict], run: str) -> list[dict]:
    return [dict(r, id=f"{run}{i}") for i, r in enumerate(reqs)]


def _complete(req: dict, res: dict) -> bool:
    return (res.get("status") == 200 and not res.get("error") and res.get("finish_reason") == "length"
            and res.get("tokens") == req["max_tokens"])


def _leftovers(dep, timeout_s: float = 60.0) -> dict[str, int]:
    """Per replica, what it still holds once idle: used pool indices and host-pool slots, rank
    backups, listed requests. Empty when every replica is back at its baseline."""
    import time

    import ray

    coords = [r.coordinator for r in dep.replicas]
    deadline = time.monotonic() + timeout_s
    while not all(ray.get([c.is_idle_clean.remote() for c in coords], timeout=60)):
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out = {}
    for r in dep.replicas:
        c = r.coordinator
        if not ray.get(c.check_invariants.remote(), timeout=60):
            raise RuntimeError(f"soak: {r.role}/{r.index}: pool invariants broken")
        units = sum(u["used"] + u["host_used"] for u in ray.get(c.pools.remote(), timeout=60)["components"].values())
        ranks = ray.get(c.rank_handles.remote(), timeout=60)
        units += sum(ray.get([h.num_backups.remote() for h in ranks], timeout=60))
        units += len(ray.get(c.list_requests.remote(), timeout=60))
        if units:
            out[f"{r.role}/{r.index}"] = units
    return out


def _five_xx(out: dict) -> int:
    statuses = [r.get("status") for r in out["results"]] + out["poll_statuses"]
    statuses += [s for ss in out["operator"].values() for s in ss]
    return sum(1 for s in statuses if s is not None and s >= 500)


def _run(stack: GatewayStack, profile: Profile, reqs: list[dict], chaos: bool) -> dict:
    import httpx

    headers = {"Authorization": f"Bearer {stack.admin_token}"}
    interval = profile.soak_forced_interval if chaos else 0
    r = httpx.post(f"{stack.url}/admin/forced-retraction", json={"interval": interval}, headers=headers, timeout=60)
    r.raise_for_status()
    job = {"concurrency": profile.soak_concurrency, "requests": reqs, "chaos": chaos, "poll_s": POLL_S,
           "operator_period_s": profile.soak_operator_period_s, "decode_replicas": DECODE_REPLICAS,
           "settle_s": 60.0, "seed": BENCH_SEED}
    try:
        return stack.run_clients("bench.soak_client", job)
    finally:
        httpx.post(f"{stack.url}/admin/forced-retraction", json={"interval": 0}, headers=headers, timeout=60)


def run(profile: Profile) -> list[Row]:
    from hyrax.cluster.deployment import RoleSpec

    reqs = workload(profile)
    stays = [i for i, r in enumerate(reqs) if not r["vanish"]]
    config = dataclasses.replace(serve_defaults(), deterministic=True)
    roles = [RoleSpec("prefill", 1, 1), RoleSpec("decode", DECODE_REPLICAS, 1)]
    stack = GatewayStack(demo_model_dir(), MODEL_NAME, roles, config, "soak")
    try:
        progress(f"soak: baseline, {len(stays)} staying clients, no chaos")
        base = _run(stack, profile, _with_ids([reqs[i] for i in stays], "base"), chaos=False)
        base_left = _leftovers(stack.dep)
        progress(f"soak: chaos, {len(reqs)} clients ({len(reqs) - len(stays)} vanish), forced retraction every "
                 f"{profile.soak_forced_interval} steps, an operator every {profile.soak_operator_period_s}s")
        chaos = _run(stack, profile, _with_ids(reqs, "chaos"), chaos=True)
        chaos_left = _leftovers(stack.dep)
    finally:
        stack.close()

    base_res = {i: res for i, res in zip(stays, base["results"])}
    chaos_res = dict(enumerate(chaos["results"]))
    lost_base = [i for i in stays if not _complete(reqs[i], base_res[i])]
    lost = [i for i in stays if not _complete(reqs[i], chaos_res[i])]
    listed = chaos["still_listed"] + base["still_listed"]
    differ = [i for i in stays if i not in lost and i not in lost_base and chaos_res[i]["text"] != base_res[i]["text"]]
    leaked = sum(base_left.values()) + sum(chaos_left.values())
    five = _five_xx(base) + _five_xx(chaos)
    if lost or lost_base:
        i = (lost or lost_base)[0]
        progress(f"soak: lost, e.g. request {i}: baseline {base_res[i]}, chaos {chaos_res[i]}")
    if leaked:
        progress(f"soak: leftovers after the baseline {base_left}, after chaos {chaos_left}")
    closed = {f"chaos{i}": res["closed"] for i, res in chaos_res.items() if reqs[i]["vanish"] and res.get("closed")}
    # per vanished client: from closing its connection to the last listing that showed its
    # request, measured to that listing's answer (an upper bound) and to its sending (a lower one)
    held = {cid: [max(0.0, chaos["seen"][cid][k] - t) if cid in chaos["seen"] else 0.0 for k in (1, 0)]
            for cid, t in closed.items()}
    longest_ms, longest_low_ms = (max((h[k] for h in held.values()), default=0.0) * 1000.0 for k in (0, 1))
    by_kind: dict[str, float] = {}
    for cid, (hi, _) in held.items():
        r = reqs[int(cid[len("chaos"):])]
        kind = f"after {r['after_chunks']} chunks" if r["stream"] else "non-streaming"
        by_kind[kind] = max(by_kind.get(kind, 0.0), hi * 1000.0)
    trips = sorted(chaos["poll_round_trips"])
    progress(f"soak: baseline {base['wall']:.1f}s, chaos {chaos['wall']:.1f}s; operator answers "
             + ", ".join(f"{k}: {sorted(set(v))} x{len(v)}" for k, v in chaos["operator"].items()))
    progress(f"soak: {len(closed)} clients vanished mid-request; longest held {longest_low_ms:.0f}-{longest_ms:.0f} ms "
             f"(listing round trip p50 {trips[len(trips) // 2] * 1000:.0f} ms, max {trips[-1] * 1000:.0f} ms); "
             "upper bound by kind (ms): " + ", ".join(f"{k}: {v:.0f}" for k, v in sorted(by_kind.items())))
    worst = sorted(held, key=lambda c: held[c][0], reverse=True)[:5]
    progress("soak: longest held, last listed as: "
             + "; ".join(f"{held[c][1] * 1000:.0f}-{held[c][0] * 1000:.0f} ms {chaos['seen'][c][2]}" for c in worst))
    good = {"base": sum(reqs[i]["max_tokens"] for i in stays if i not in lost_base) / base["wall"],
            "chaos": sum(reqs[i]["max_tokens"] for i in stays if i not in lost) / chaos["wall"]}
    n = len(reqs)
    return [
        Row(f"soak: requests lost (of {n} under chaos + {len(stays)} baseline)", len(lost) + len(lost_base) + len(listed),
            None, len(lost) + len(lost_base) + len(listed), "== 0"),
        Row("soak: pool units leaked (indices, host slots, rank backups, listed requests)", leaked, None, leaked,
            "== 0"),
        Row("soak: 5xx answers (clients, operator, poller)", five, None, five, "== 0"),
        Row(f"soak: completed outputs differing from the run without chaos (of {len(stays)})", len(differ), None,
            len(differ), "== 0"),
        Row("soak: goodput tok/s under chaos vs without (staying clients)", good["chaos"], good["base"],
            ratio(good["chaos"], good["base"])),
        Row(f"soak: longest a vanished client's request stayed listed, ms, upper bound (baseline: poll interval; "
            f"{len(closed)} vanished)", longest_ms, POLL_S * 1000.0, ratio(longest_ms, POLL_S * 1000.0)),
    ]
