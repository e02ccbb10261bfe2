"""Hand-offs between replicas (prefill -> decode, live migration), the source's and the
target's halves of one protocol:

1. the source **offers**: every rank exports its shard of every component into the object
   store; the request moves to OFFERED with a lease, its device state and the payload's refs
   kept alive;
2. the target **imports** into new indices, verifies every shard on every rank, and
   **acknowledges** to the source;
3. the source **frees** on the acknowledgement, or when the lease ends without one, or as soon
   as the gateway that carries the hand-off lost its lease (its process is gone or frozen: it
   will bring the offer to no importer, `reclaim_carried`); or, when
   no other replica took the offer and its client is still there, the gateway brings it back
   and the source **takes it back**: it runs on from the state it kept (DESIGN's "resumed
   locally").

A client that goes away aborts the request wherever it is, OFFERED included (`Engine.abort`).
"""
from __future__ import annotations

import time
from typing import Callable

from hyrax.actors.engine.lifecycle import Outcome, RequestTable
from hyrax.actors.engine.request import Request, State
from hyrax.actors.engine.moves import Backup, Location, Place, StateMoves
from hyrax.actors.engine.rank_failure import RankFailure
from hyrax.actors.engine.stats import EngineStats
from hyrax.actors.model.errors import HyraxInputError


class Transfers:
    """Both halves over the engine's parts. What they ask of the engine is three calls:
    `settle(req_id)` commits the step in flight if it runs that request; `leave(req, reason)`
    ends a request here without counting it as finished (another replica has it, or nobody
    will); `load(req)` restores a retracted request's state and moves it in the table."""

    def __init__(self, table: RequestTable, moves: StateMoves, stats: EngineStats, lease_s: float,
                 settle: Callable[[str], None], leave: Callable[[Request, str], None],
                 load: Callable[[Request], Outcome]):
        self.table, self.moves, self.stats, self.lease_s = table, moves, stats, lease_s
        self.settle, self.leave, self.load = settle, leave, load

    # ---- source side -----------------------------------------------------------------
    def offer(self, req_id: str) -> dict | None:
        """Export a running request for another replica and hold its state under a lease.
        None when committing the step in flight ended or retracted it meanwhile."""
        req = self.table.get(req_id)
        if req is None or req.state != State.RUNNING:
            raise HyraxInputError(f"request {req_id!r} is not running here")
        self.settle(req_id)  # the exported state is exactly the committed tokens
        if req.state != State.RUNNING:  # that step finished it, or a retraction took it
            return None
        t0 = time.perf_counter()
        saved = self.moves.save(req, Location(Place.OBJECT_STORE))
        payload = list(saved.location.payload)
        self.table.offer(req, self.lease_s)
        # the exported shards are objects this replica owns: hold their refs until the importer
        # acknowledged, so they cannot be freed while it is still fetching them
        req.export_payload = payload
        self.stats.transfer_seconds.append(time.perf_counter() - t0)
        return {
            "request": {"id": req.id, "prompt_ids": list(req.prompt_ids), "output_ids": list(req.output_ids),
                        "params": req.params, "seed": req.seed, "retractions": req.retractions, "hops": req.hops,
                        "arrival_wall": time.time() - (time.monotonic() - req.arrival)},
            "manifest": saved.manifest,
            "payload": payload,
            "lease_s": self.lease_s,
        }

    def acknowledged(self, req_id: str) -> bool:
        """The importer has the request: free its state here. Not counted as finished."""
        req = self.table.offered.get(req_id)
        if req is None:
            return False
        self.leave(req, "transferred")
        self.stats.transfers_out += 1
        return True

    def reclaim_expired(self, now: float) -> list[str]:
        """Offers whose lease ended without an acknowledgement: the importer (or the gateway
        carrying the offer) is gone. Free their state here."""
        return self._reclaim(self.table.expired_offers(now), "lease_expired")

    def carried(self, req_id: str, gateway: str) -> None:
        """The stream that ended with the hand-off of `req_id` belongs to `gateway`: that gateway
        carries the offer to the importer (or back here)."""
        req = self.table.offered.get(req_id)
        if req is not None:
            req.offer_carrier = gateway

    def reclaim_carried(self, gateway: str) -> list[str]:
        """The offers `gateway` carries, once it lost its lease: free their state here now, not
        when their own lease ends. An importer that got the hand-off before (it acknowledges
        later, `acknowledged` then finds no offer) holds its own copy; one that gets it later
        (the gateway was only frozen) imports from the payload it carries, as after a lease."""
        return self._reclaim([r for r in self.table.offered.values() if r.offer_carrier == gateway], "carrier_gone")

    def _reclaim(self, offers: list, why: str) -> list[str]:
        """Free the state of `offers` (no importer will acknowledge them); their ids."""
        for req in offers:
            self.leave(req, why)
            self.stats.offers_reclaimed += 1
        return [req.id for req in offers]

    def take_back(self, handoff: dict) -> Outcome | None:
        """Run on a request this replica offered and no other replica took (its gateway brings
        the hand-off back): its state never left the pools, so nothing is copied or verified.
        None when the hand-off is not that offer: none is held (its lease ended), or the request
        went on elsewhere since (a replica that took it was lost after streaming tokens, and its
        gateway hands on the tokens alone); a stale offer held here is freed, and the caller
        imports the hand-off as any other."""
        r = handoff["request"]
        req = self.table.offered.get(r["id"])
        if req is None:
            return None
        if list(r["output_ids"]) != req.output_ids:
            self.leave(req, "lease_expired")  # what it offered is behind the request now
            self.stats.offers_reclaimed += 1
            return None
        self.table.take_back(req)
        req.export_payload = None  # the exported shards are nobody's to fetch now
        self.stats.offers_taken_back += 1
        return Outcome.TAKEN_BACK

    # ---- target side -------------------------------------------------------------------
    def import_(self, handoff: dict) -> Outcome:
        """Take over a request offered by another replica: allocate new indices, import and
        verify every component on every rank. VERIFIED, a fallback (FALLBACK,
        CHECKSUM_MISMATCH: rebuilt by prefill here), RECOMPUTE (a hand-off without state, from a
        replica that was lost: rebuilt by prefill here), or NO_CAPACITY (queued, imported when
        memory allows)."""
        r = handoff["request"]
        if r["id"] in self.table:
            raise HyraxInputError(f"request id {r['id']!r} is already in use")
        req = Request(r["id"], list(r["prompt_ids"]), r["params"], r["seed"], output_ids=list(r["output_ids"]))
        req.retractions = r.get("retractions", 0)
        req.hops = r.get("hops", 0) + 1
        # no manifest: the source is gone with the state (its node was lost); rebuild from the tokens
        req.backup = (None if handoff["manifest"] is None
                      else Backup(handoff["manifest"], Location(Place.OBJECT_STORE, payload=tuple(handoff["payload"]))))
        self.table.import_(req)
        t0 = time.perf_counter()
        try:
            result = self.load(req)
        except RankFailure:  # the replica recovers and rebuilds it; the import answers that (loop.py)
            self.stats.transfers_in[Outcome.RANKS_FAILED.value] += 1
            raise
        self.stats.transfer_seconds.append(time.perf_counter() - t0)
        self.stats.transfers_in[result.value] += 1
        return result
