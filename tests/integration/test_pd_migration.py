"""Live migration of running requests between decode replicas over the PD export/import
path (admin `migrate` and `drain`): the migrated request's output equals the uninterrupted
run token for token, the bytes moved equal the formula at the migration point, the source
replica's pools return to baseline, and a drained replica takes no new work.

Deployment: a TP=1 prefill replica, two TP=1 decode replicas, and a TP=2 "colocated"
replica (a decode target too; the session demo deployment's TP=2 one, borrowed), so a request
can also migrate across TP sizes (1 -> 2 -> 1).
Overlap scheduling on, as `hyrax serve` runs it: every hop delivers the tokens its export
committed before the hand-off.
"""
from __future__ import annotations

import asyncio
import time

import pytest
import ray

from hyrax.actors.engine.commands import ListRequests, Stats
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.model.config import ModelConfig
from pd_harness import (
    Run, all_stats, assert_all_clean, assert_outputs, drive, pd_deployed, row_bytes, stats, stats_delta, wait_for,
)
from ray_harness import DEMO_CONFIG, DEMO_MODEL, prompt, reference, replica, uid

pytestmark = pytest.mark.timeout(300)

CONFIG = EngineConfig(deterministic=True, overlap=True, compiled_graph=True)  # the `hyrax serve` defaults
WINDOW = ModelConfig.from_dir(DEMO_MODEL).sliding_window


@pytest.fixture(scope="module")
def pd(demo_deployment):
    """The TP=2 "colocated" replica is the session demo deployment's "tp2" one: the same
    checkpoint, config (DEMO_CONFIG == CONFIG) and engine role, so it is borrowed, not started."""
    from hyrax.cluster.deployment import RoleSpec

    assert DEMO_CONFIG == CONFIG
    roles = [RoleSpec("prefill", 1, 1), RoleSpec("decode", 2, 1)]
    with pd_deployed(roles, CONFIG, borrowed={"colocated": replica(demo_deployment, "tp2")}) as (d, client):
        yield d, client


def _backend(client, role: str, index: int = 0):
    b = client.find_backend(role, index)
    assert b is not None, (role, index)
    return b


async def _ids_on(backend) -> dict[str, str]:
    return {r["id"]: r["state"] for r in await backend.run(ListRequests())}


async def _until(fetch, pred, what: str, timeout: float = 30.0):
    """Poll an async `fetch()` until `pred(value)`; returns the value."""
    deadline = time.monotonic() + timeout
    while True:
        value = await fetch()
        if pred(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {value}")
        await asyncio.sleep(0.02)


async def _stats(backend) -> dict:
    return await backend.run(Stats())


def _migrated_tokens(moved: dict[str, int]) -> int:
    """Committed tokens of a migrated state, from its full_kv bytes; checks the rest of the formula."""
    rows = row_bytes()
    n, rem = divmod(moved["full_kv"], rows["full_kv"])
    assert rem == 0, moved
    assert moved == {"full_kv": n * rows["full_kv"], "swa_kv": min(n, WINDOW - 1) * rows["swa_kv"],
                     "mamba_conv": rows["mamba_conv"], "mamba_ssm": rows["mamba_ssm"]}, (n, moved)
    return n


def test_migrate_mid_decode_across_replicas_and_tp_sizes_matches_uninterrupted_run(pd):
    """One request hops decode(tp1) -> other decode(tp1) -> colocated(tp2) -> decode(tp1)
    while two bystanders keep decoding; every hop is verified, moves exactly the formula's
    bytes, and frees the request at its source at once."""
    d, client = pd
    lengths, max_tokens = [90, 30, 120], [150, 40, 40]
    prompts = [prompt(n, seed=900 + n) for n in lengths]
    want = reference(DEMO_MODEL, CONFIG, prompts, max_tokens)
    runs = [Run(uid(f"mig{i}"), p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    mover = runs[0]
    hops: list[dict] = []

    async def during(runs):
        # hand-offs from prefill go to the two TP=1 decode replicas only; the explicit
        # migration targets below ignore draining
        colo = _backend(client, "colocated")
        await client.drain(colo)
        try:
            await wait_for(lambda: all(len(r.tokens) >= 2 for r in runs), what="every request decoding")
        finally:
            await client.undrain(colo)
        first = client.owner[mover.id]
        assert first.role == "decode", first.role
        other = _backend(client, "decode", 1 - first.index)
        plan = [other, _backend(client, "colocated"), first]  # tp1 -> tp1, tp1 -> tp2, tp2 -> tp1
        for dst in plan:
            src = client.owner[mover.id]
            before = {id(b): await _stats(b) for b in (src, dst)}
            seen = len(mover.tokens)
            res = await client.migrate(mover.id, dst)
            assert res == (Outcome.MIGRATING, dst), res
            await wait_for(lambda: client.owner.get(mover.id) is dst, what=f"hand-off to {dst.role}/{dst.index}")
            # the source released the request (no HANDOFF indices left behind) while it still decodes
            await _until(lambda: _ids_on(src), lambda ids: mover.id not in ids,
                         f"{src.role}/{src.index} to release {mover.id}")
            state = (await _ids_on(dst)).get(mover.id)
            after = {id(b): await _stats(b) for b in (src, dst)}
            assert state in ("running", None), ("not running on the target", state,
                                                stats_delta(before[id(dst)], after[id(dst)]))
            hops.append({"src": src, "dst": dst, "seen": seen, "mover_done": mover.finish_reason is not None,
                         "src_delta": stats_delta(before[id(src)], after[id(src)]),
                         "dst_delta": stats_delta(before[id(dst)], after[id(dst)])})
            try:
                await wait_for(lambda: len(mover.tokens) >= seen + 10, what="tokens after the hop")
            except AssertionError as e:  # say where the request is: a rare CI timeout here
                where = {f"{b.role}/{b.index}": (await _ids_on(b)).get(mover.id) for b in (src, dst)}
                raise AssertionError(f"{e}: hop {src.role}/{src.index} -> {dst.role}/{dst.index}, "
                                     f"{len(mover.tokens)} tokens (had {seen}), items {mover.items[-3:]}, "
                                     f"state {where}, dst stats {stats_delta(after[id(dst)], await _stats(dst))}") from None

    drive(client, runs, during)
    assert_outputs(runs, want)
    assert len(hops) == 3
    prev_n = 0
    for h in hops:
        name = f"{h['src'].role}/{h['src'].index} -> {h['dst'].role}/{h['dst'].index}"
        assert not h["mover_done"], f"{name}: request finished before the hop was checked"
        assert h["src_delta"]["transfers_out"] == 1, (name, h["src_delta"])
        assert h["dst_delta"]["transfers_in"] == {"verified": 1}, (name, h["dst_delta"])
        assert h["dst_delta"]["checksum_failures"] == 0 and h["dst_delta"]["restore_fallbacks"] == 0
        moved = {k: v for k, v in h["dst_delta"]["bytes_transferred"].items() if v}
        n = _migrated_tokens(moved)
        # mid-decode: prompt + every token generated so far but the last (not yet computed)
        assert lengths[0] + h["seen"] - 1 <= n < lengths[0] + max_tokens[0], (name, n, h["seen"])
        assert n > prev_n, (name, n, prev_n)
        prev_n = n
    assert_all_clean(d)


def test_drain_decode_replica_with_8_running_requests_finishes_them_elsewhere(pd):
    d, client = pd
    dec0, dec1, colo = _backend(client, "decode", 0), _backend(client, "decode", 1), _backend(client, "colocated")
    lengths = [12, 25, 40, 63, 64, 80, 110, 140]
    prompts = [prompt(n, seed=1000 + n) for n in lengths]
    max_tokens = [48 + 2 * i for i in range(len(prompts))]
    want = reference(DEMO_MODEL, CONFIG, prompts, max_tokens)
    later_prompts = [prompt(n, seed=1100 + n) for n in (15, 70, 100, 33)]
    want_later = reference(DEMO_MODEL, CONFIG, later_prompts, 10)
    runs = [Run(uid(f"drain{i}"), p, m) for i, (p, m) in enumerate(zip(prompts, max_tokens))]
    result: dict = {}

    async def isolate():
        # put all eight on decode/0: the other decode targets take no new requests for now
        # (drained before the first request is submitted, so none is routed there meanwhile)
        for b in (dec1, colo):
            assert (await client.drain(b))["migrations"] == {}

    asyncio.run(isolate())

    async def during(runs):
        await wait_for(lambda: all(len(r.tokens) >= 2 for r in runs), what="every request decoding")
        on0 = await _ids_on(dec0)
        assert on0 == {r.id: "running" for r in runs}, on0
        for b in (dec1, colo):
            await client.undrain(b)
        result["before"] = {id(b): await _stats(b) for b in (dec0, dec1, colo)}
        result["drain"] = await client.drain(dec0)

    drive(client, runs, during)
    assert_outputs(runs, want)
    res = result["drain"]
    assert res["draining"] == "decode/0"
    assert set(res["migrations"]) == {r.id for r in runs}
    assert all(v.startswith("migrating to ") for v in res["migrations"].values()), res["migrations"]
    assert res["remaining"] == 0
    assert_all_clean(d)  # decode/0 ends with empty pools, every target too

    s_after = all_stats(d)
    deltas = {id(b): stats_delta(result["before"][id(b)], s_after[(b.role, b.index)]) for b in (dec0, dec1, colo)}
    assert deltas[id(dec0)]["transfers_out"] == len(runs)
    ins = {f"{b.role}/{b.index}": deltas[id(b)]["transfers_in"] for b in (dec0, dec1, colo)}
    assert sum(deltas[id(b)]["transfers_in"].get("verified", 0) for b in (dec1, colo)) == len(runs), ins
    assert all(set(deltas[id(b)]["transfers_in"]) <= {"verified"} for b in (dec1, colo)), deltas
    assert not any(deltas[id(dec0)]["transfers_in"].values()), deltas[id(dec0)]

    # drained: new requests go elsewhere; decode/0 neither imports nor runs anything
    frozen = s_after[("decode", 0)]
    later = drive(client, [Run(uid(f"late{i}"), p, 10) for i, p in enumerate(later_prompts)])
    assert_outputs(later, want_later)
    now = all_stats(d)[("decode", 0)]
    for k in ("transfers_in", "prompt_tokens", "generation_tokens", "bytes_transferred", "steps"):
        assert now[k] == frozen[k], (k, frozen[k], now[k])
    # ... the other decode targets took every new request
    def imported(st: dict) -> int:
        return sum(st[(b.role, b.index)]["transfers_in"].get("verified", 0) for b in (dec1, colo))

    assert imported(all_stats(d)) == imported(s_after) + len(later)
    assert ray.get(dec0.handle.load.remote(), timeout=30) == 0
    assert_all_clean(d)
    asyncio.run(client.undrain(dec0))


def test_a_migration_with_nowhere_to_go_runs_on_at_its_source(pd):
    """Over Ray: the decode replica a request runs on exports it for a migration, and by the
    time the hand-off reaches the gateway no other replica that decodes is in service. The
    gateway brings the offer back; the source takes it back (its state never left) and the
    request continues there token for token, instead of ending with a 503 (test_migrate_take_back.py
    covers the other ways an offer comes back, in process)."""
    from hyrax.actors.engine.commands import MigrateOut

    d, client = pd
    p = prompt(60, seed=977)
    want = reference(DEMO_MODEL, CONFIG, [p], [80])
    run = Run(uid("back"), p, 80)

    async def during(runs):
        colo = _backend(client, "colocated")
        await client.drain(colo)  # the prefill replica hands off to a TP=1 decode replica
        try:
            await wait_for(lambda: len(run.tokens) >= 2, what="the request decoding")
        finally:
            await client.undrain(colo)
        src = client.owner[run.id]
        assert src.role == "decode", src.role
        others = [b for b in client.backends if b.role in ("decode", "colocated") and b is not src]
        before, seen = await _stats(src), len(run.tokens)
        for b in others:
            client._refused(b, {"error": "out of service for this test"})
        try:
            assert await src.run(MigrateOut(run.id, (others[0].role, others[0].index)))
            await wait_for(lambda: len(run.tokens) >= seen + 10, what="tokens after the offer came back")
        finally:
            for b in others:
                client.out_of_service.pop(id(b), None)
        assert client.owner[run.id] is src
        delta = stats_delta(before, await _stats(src))
        assert delta["offers_taken_back"] == 1 and delta["transfers_out"] == 0, delta

    drive(client, [run], during)
    assert_outputs([run], want)
    assert_all_clean(d)


def test_a_prefill_hand_off_with_nowhere_to_go_is_decoded_by_the_prefill_replica(pd):
    """Over Ray: no replica that decodes is in service when the prefill replica hands a request
    off after its first token. The prefill replica takes its offer back and decodes the request
    to its end itself, token for token as the uninterrupted run, instead of a 503 after one
    token (test_migrate_take_back.py covers the refusal and failed-import cases in process)."""
    d, client = pd
    p = prompt(40, seed=978)
    want = reference(DEMO_MODEL, CONFIG, [p], [48])
    run = Run(uid("pf-back"), p, 48)
    src = _backend(client, "prefill")
    others = [b for b in client.backends if b.role in ("decode", "colocated")]
    before = stats(d, "prefill")

    async def during(runs):
        await wait_for(lambda: len(run.tokens) >= 10, what="tokens after the first")
        assert client.owner[run.id] is src

    for b in others:
        client._refused(b, {"error": "out of service for this test"})
    try:
        drive(client, [run], during)
    finally:
        for b in others:
            client.out_of_service.pop(id(b), None)
    assert_outputs([run], want)
    delta = stats_delta(before, stats(d, "prefill"))
    assert delta["offers_taken_back"] == 1 and delta["transfers_out"] == 0, delta
    assert_all_clean(d)
