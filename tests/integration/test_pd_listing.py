"""`GET /admin/requests` (EngineClient.list_requests) during prefill -> decode hand-offs: each
request is listed once, by the replica that owns it, at every moment.

A request handed off is held by both replicas for a moment: the prefill replica lists it
`offered` until the decode replica's acknowledgement frees it there, and the decode replica
lists it from its import on. The listing showed it twice then (once per replica). Now the
owner is the row with the most hops (imports), and the prefill replicas are asked first, so a
request is never missing either (a prefill replica lets one go only after it was imported).

Deployment: prefill TP=1 + decode TP=1, the `hyrax serve` engine defaults (overlap, compiled).
"""
from __future__ import annotations

import asyncio
from collections import Counter

import pytest

from hyrax.actors.engine.commands import ListRequests
from hyrax.actors.engine.config import EngineConfig
from pd_harness import Run, assert_all_clean, drive, pd_deployed
from ray_harness import prompt, uid

pytestmark = pytest.mark.timeout(300)

CONFIG = EngineConfig(deterministic=True, overlap=True, compiled_graph=True)


@pytest.fixture(scope="module")
def pd(ray_session):
    from hyrax.cluster.deployment import RoleSpec

    with pd_deployed([RoleSpec("prefill", 1, 1), RoleSpec("decode", 1, 1)], CONFIG) as (d, client):
        yield d, client


def _round(client, k: int) -> tuple[list[list[dict]], int, list[Run]]:
    """16 requests streamed while the listing is read in a loop: the listings, how many times the
    replicas' own answers showed a request on both (a hand-off's window), and the runs."""
    runs = [Run(uid(f"list{k}-{i}"), prompt(20 + 9 * i, seed=1300 + 16 * k + i), 12) for i in range(16)]
    listings: list[list[dict]] = []
    overlaps = 0

    async def during(runs):
        nonlocal overlaps
        while not all(r.finish_reason for r in runs):
            listings.append(await client.list_requests())
            raw = await asyncio.gather(*(b.run(ListRequests()) for b in client.backends))
            overlaps += sum(1 for n in Counter(r["id"] for rows in raw for r in rows).values() if n > 1)

    drive(client, runs, during)
    assert all(r.finish_reason == "length" and r.error is None for r in runs), [(r.id, r.error) for r in runs]
    return listings, overlaps, runs


def _check(listings: list[list[dict]], runs: list[Run]) -> None:
    ours = {r.id for r in runs}
    for k, rows in enumerate(listings):
        twice = [rid for rid, n in Counter(r["id"] for r in rows).items() if n > 1]
        assert not twice, f"listing {k} shows {twice} more than once: {[r for r in rows if r['id'] in twice]}"
    for rid in ours:  # from its first listing to its last, in every one: never missing meanwhile
        seen = [k for k, rows in enumerate(listings) if any(r["id"] == rid for r in rows)]
        if seen:
            missing = [k for k in range(seen[0], seen[-1] + 1) if k not in seen]
            assert not missing, f"{rid} is missing from listings {missing} between {seen[0]} and {seen[-1]}"


def test_a_request_handed_from_prefill_to_decode_is_listed_once_by_its_one_owner_throughout(pd):
    """Rounds until one listing fell inside a hand-off (both replicas held a request as they
    answered), at most 5; every listing of every round is checked."""
    d, client = pd
    overlaps = 0
    for k in range(5):
        listings, seen, runs = _round(client, k)
        _check(listings, runs)
        overlaps += seen
        if overlaps:
            break
    assert overlaps > 0, "no listing fell inside a hand-off in 5 rounds: the test saw nothing to judge"
    assert_all_clean(d)
