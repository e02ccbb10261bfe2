"""Moving a request's state between locations: one operation over every component and rank.

A request's state runs in the device pools and waits in one of three places:
RANK_MEMORY (tensors each rank keeps: the `cpu_tensor` backup mode), HOST_POOL (rows of each
rank's pre-allocated host pool) or OBJECT_STORE (shards exported for another replica).

- `save`: device -> a place. Every rank copies its shard of every component and reports
  checksums; the one `Manifest` records them. Retraction backs up by a save, a hand-off
  (PD or migration) offers by a save.
- `load`: a place -> *new* device indices. Every rank writes, reads back and reports; the
  request runs again only if every component verifies on every rank (one verification).
  Restore and import are loads.
- Anything else — no state kept, an incomplete manifest, a failed copy, a mismatch — falls
  back to recompute: the state is dropped and the request is rebuilt by prefill (one fallback).
  Except a lost rank (`RankFailure`: died, hung, raised): what every rank holds is suspect, so
  it goes to the caller, whose loop replaces the ranks and rebuilds every request (loop.py's
  `_recover`); the units this replica allocated for the move are given back first.

Device indices are freed only after every rank acknowledged a save, through the engine's one
free point (`release`). Test-only faults subclass this (`hyrax.testing.faults`).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field, replace

import numpy as np

from hyrax.actors.engine.allocator import AllocationError, IndexAllocator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.indices import IndexTable
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.manifest import ComponentRecord, Manifest
from hyrax.actors.engine.rank_failure import RankFailure
from hyrax.actors.engine.request import Request
from hyrax.actors.engine.stats import EngineStats
from hyrax.actors.engine.statecopy import live_page_numbers, live_rows, pages_needed
from hyrax.actors.model.state import ComponentSpec

Rows = dict[str, "np.ndarray | list[int]"]  # component -> pool rows: (rows,) int64 or a list of them


class Place(str, enum.Enum):
    RANK_MEMORY = "cpu_tensor"
    HOST_POOL = "host_pool"
    OBJECT_STORE = "transfer"  # exported for another replica


@dataclass(frozen=True)
class Location:
    place: Place
    host_rows: Rows | None = None  # HOST_POOL: rows per component (the same on every rank)
    payload: tuple | None = None  # OBJECT_STORE: one StateShard (manifest.py; an object ref over Ray) per exporting rank

    @property
    def here(self) -> bool:
        """Saved by this replica's ranks (not handed over by another replica)."""
        return self.place != Place.OBJECT_STORE


@dataclass
class Backup:
    """Saved state: what it holds (manifest) and where it is."""

    manifest: Manifest
    location: Location
    was: dict[str, set[int]] = field(default_factory=dict)  # the device units it was saved from, every component


def make_moves(components: tuple[ComponentSpec, ...], config: EngineConfig, executor,
               allocators: dict[str, IndexAllocator], host_allocators: dict[str, IndexAllocator],
               stats: EngineStats, release, cache) -> StateMoves:
    """The state mover for `config`: with test-only faults (refused unless allow_unsafe), the
    fault-injecting one; chosen here, once, so the production path has no fault branches."""
    cls = StateMoves
    if config.faults.any:
        from hyrax.testing.faults import UnsafeMoves
        cls = UnsafeMoves
    return cls(components, config, executor, allocators, host_allocators, stats, release, cache)


class StateMoves:
    def __init__(self, components: tuple[ComponentSpec, ...], config: EngineConfig, executor,
                 allocators: dict[str, IndexAllocator], host_allocators: dict[str, IndexAllocator],
                 stats: EngineStats, release, cache):
        self.components = components
        self.config = config
        self.executor = executor
        self.alloc = allocators
        self.host_alloc = host_allocators
        self.stats = stats
        self.release = release  # the engine's one free point (deferred past the step in flight)
        self.cache = cache  # the prefix cache (caching.py): units it owns are never freed here
        self.row_bytes = {c.name: c.row_bytes for c in components}  # (a property that asks torch each time)

    # ---- indices ---------------------------------------------------------------------
    def free_device(self, req: Request) -> None:
        """Give back every unit the request owns (units of the prefix cache in its tables stay
        the cache's) and let go of what it holds of the cache."""
        owned = {c.name: self.cache.owned(req, c.name, req.indices.get(c.name, [])) for c in self.components}
        self.release(req.id, {n: i for n, i in owned.items() if i})
        self.cache.detach(req)
        req.indices = IndexTable()

    def rows(self, indices: dict[str, list[int]], num_tokens: int) -> Rows:
        """The pool rows holding the live state of `num_tokens` tokens, per component."""
        return {c.name: live_rows(c, indices[c.name], num_tokens, self.config.page_size) for c in self.components}

    def page_table(self, comp: ComponentSpec, units: list[int], num_tokens: int) -> list[int]:
        """`units` placed at the page numbers that hold the live rows (a slot component: as is)."""
        if not comp.paged:
            return list(units)
        table = [-1] * pages_needed(comp, num_tokens, self.config.page_size)
        for n, page in zip(live_page_numbers(comp, num_tokens, self.config.page_size), units):
            table[n] = page
        return table

    def _allocate_live(self, req: Request, num_tokens: int, avoid: dict[str, set[int]]) -> dict[str, list[int]] | None:
        """New indices covering the live state of `num_tokens` tokens, or None if they do not
        fit; indices in `avoid` are taken only when nothing else is free."""
        ps = self.config.page_size
        need = {c.name: len(live_page_numbers(c, num_tokens, ps)) for c in self.components}
        short = {n: k - self.alloc[n].num_free for n, k in need.items() if not self.alloc[n].can_allocate(k)}
        # cached prefixes go before a restore or an import waits for room (free now, or once
        # the step in flight is committed: then a later try fits)
        if short and self.cache.evict(short):
            short = {n: k for n, k in need.items() if not self.alloc[n].can_allocate(k)}
        if short:
            return None
        return {c.name: self.page_table(c, self.alloc[c.name].allocate(req.id, need[c.name],
                                                                       avoid.get(c.name, frozenset())), num_tokens)
                for c in self.components}

    # ---- save: device -> a place -------------------------------------------------------
    def save(self, req: Request, location: Location) -> Backup:
        """Copy the request's committed state on every rank to `location` (raises if a rank fails)."""
        rows = self.rows(req.indices, req.num_computed)
        sums, shards = self.executor.save(req.id, rows, location)
        manifest = Manifest(req.id, req.num_computed, location.place.value, num_ranks=len(sums))
        for c in self.components:  # a component no rank reported stays absent
            per_rank = {r: s[c.name] for r, s in sums.items() if c.name in s}
            if per_rank:
                n = len(rows[c.name])
                manifest.components[c.name] = ComponentRecord(
                    c.name, [i for i in req.indices[c.name] if i >= 0], n, n * self.row_bytes[c.name], per_rank)
        was = {c.name: {i for i in req.indices.get(c.name, []) if i >= 0} for c in self.components}
        return Backup(manifest, replace(location, payload=tuple(shards)) if shards is not None else location, was)

    def retract(self, req: Request, trigger: str, mode: str | None = None) -> str:
        """Back up (or drop) a running request's state and free its device indices. Returns
        the mode actually used."""
        mode = mode or self.config.retraction_backup
        t0 = time.perf_counter()
        req.backup = self._backup(req, Place(mode)) if mode != Outcome.RECOMPUTE else None
        self.free_device(req)  # only after every rank acknowledged its backup
        if req.backup is None:
            mode, req.num_computed = Outcome.RECOMPUTE.value, 0
        else:
            for name, rec in req.backup.manifest.components.items():
                self.stats.bytes_backed_up[name] += rec.bytes * len(rec.checksums)
        self.stats.retractions[(trigger, mode)] += 1
        self.stats.backup_seconds.append(time.perf_counter() - t0)
        return mode

    def _backup(self, req: Request, place: Place) -> Backup | None:
        location = Location(place)
        if place == Place.HOST_POOL:
            rows = self.rows(req.indices, req.num_computed)
            if not all(self.host_alloc[n].can_allocate(len(r)) for n, r in rows.items()):
                self.stats.host_pool_full += 1
                return None
            location = Location(place, {n: self.host_alloc[n].allocate(req.id, len(r)) for n, r in rows.items()})
        try:
            return self.save(req, location)
        except RankFailure:  # nothing to discard on ranks that are replaced: the recovery's
            self._free_host_rows(req.id, location)
            raise
        except Exception:
            self._drop(req.id, location)
            return None

    def _drop(self, req_id: str, location: Location) -> None:
        if not location.here:  # remote shards live in the object store, not on our ranks
            return
        try:
            self.executor.discard(req_id)
        finally:
            self._free_host_rows(req_id, location)

    def _free_host_rows(self, req_id: str, location: Location) -> None:
        for name, idx in (location.host_rows or {}).items():
            self.host_alloc[name].free(req_id, idx)

    def release_backup(self, req: Request) -> None:
        """Discard a request's saved state everywhere (abort, fallback, after a load)."""
        if req.backup is not None:
            self._drop(req.id, req.backup.location)
            req.backup = None

    # ---- load: a place -> new device indices -------------------------------------------
    def load(self, req: Request) -> Outcome:
        """Bring saved state into new device indices. VERIFIED: it can run; RECOMPUTE /
        FALLBACK / CHECKSUM_MISMATCH: its state is dropped, it must be rebuilt by prefill;
        NO_CAPACITY: left as it was (also when a rank is lost: RankFailure, raised). The caller
        moves it in the request table."""
        backup: Backup | None = req.backup
        if backup is None:
            return self._recompute(req, Outcome.RECOMPUTE, count=False)
        m, loc = backup.manifest, backup.location
        # New memory, really: the allocator hands out the most recently freed index first,
        # which after a retract-then-restore would be the request's own old slot and pages,
        # still holding its bytes — a backup that left a component out would then look
        # lossless. Avoiding them whenever the pool has other room makes every restore
        # exercise the copy it claims to make.
        # (every component's, also one a faulty backup left out of its manifest)
        avoid = backup.was if loc.here else {}
        new = self._allocate_live(req, m.num_tokens, avoid)
        if new is None:
            return Outcome.NO_CAPACITY
        t0 = time.perf_counter()
        req.indices = IndexTable({name: tuple(units) for name, units in new.items()})
        try:
            target = self.target_rows(req, backup)
            self.precheck(req, m, target)
            ok = self.verified(self.executor.load(req.id, target, loc, m.by_rank()))
        except RankFailure:  # left as it was (its backup with it) for the recovery to rebuild
            self.free_device(req)
            raise
        except Exception:  # incomplete manifest, ownership, or a failed copy on any rank:
            self.free_device(req)  # never resume on partial state
            return self._recompute(req, Outcome.FALLBACK)
        if not ok:
            self.stats.checksum_failures += 1
            self.free_device(req)
            return self._recompute(req, Outcome.CHECKSUM_MISMATCH)
        moved = self.stats.bytes_restored if loc.here else self.stats.bytes_transferred
        for name, rec in m.components.items():
            moved[name] += rec.bytes * len(rec.checksums)
            if not loc.here:
                req.transferred_bytes[name] = req.transferred_bytes.get(name, 0) + rec.bytes * len(rec.checksums)
        self.release_backup(req)
        req.num_computed = m.num_tokens
        if loc.here:  # imports are counted as transfers by the engine
            self.stats.restores[Outcome.VERIFIED.value] += 1
            self.stats.restore_seconds.append(time.perf_counter() - t0)
        return Outcome.VERIFIED

    def target_rows(self, req: Request, backup: Backup) -> Rows:
        """Where a load writes: the rows of the request's new indices."""
        return self.rows(req.indices, backup.manifest.num_tokens)

    def precheck(self, req: Request, m: Manifest, target: Rows) -> None:
        """Before any copy: every component saved by every rank, and a target the request owns."""
        m.require_complete(self.components)
        ps = self.config.page_size
        for c in self.components:
            rows = np.asarray(target[c.name], dtype=np.int64)  # (rows,)
            units = _runs(rows // ps) if c.paged else rows.tolist()
            if not self.alloc[c.name].owns(req.id, units):
                raise AllocationError(f"{req.id}: load target of {c.name} is not owned by the request")

    def verified(self, results: dict[int, dict]) -> bool:
        """Every component on every rank read back as what that rank meant to write
        ([read back, written]; a string is a rank's error)."""
        return all(isinstance(v := res.get(c.name), list) and v[0] == v[1]
                   for res in results.values() for c in self.components)

    def _recompute(self, req: Request, result: Outcome, count: bool = True) -> Outcome:
        here = req.backup is None or req.backup.location.here
        self.release_backup(req)
        req.num_computed = 0
        req.indices = IndexTable()
        if here:  # a failed import is counted as a transfer result, not a restore
            self.stats.restore_fallbacks += count
            self.stats.restores[result.value] += 1
        return result


def _runs(units: np.ndarray) -> list[int]:
    """units: (n,) int64 -> the first of each run of equal values (every value at least once;
    one per page for the rows of a page table)."""
    if not len(units):
        return []
    first = np.empty(len(units), dtype=bool)
    first[0] = True
    np.not_equal(units[1:], units[:-1], out=first[1:])
    return units[first].tolist()
