"""Retraction and restore, coordinated over every rank and every component.

Two phases: every rank backs up its shard of every component and returns checksums; only
then are device indices freed. Restore allocates *new* indices, every rank writes and reads
back, and the request runs again only if every component's checksum matches on every rank.
Anything else falls back to recompute (re-prefill prompt + generated tokens) and is counted.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from hyrax.actors.engine.allocator import AllocationError, IndexAllocator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.manifest import ComponentRecord, Manifest
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.request import Request
from hyrax.actors.engine.selection import pick_victims  # noqa: F401 - loop.py still imports it from here
from hyrax.actors.engine.stats import EngineStats
from hyrax.actors.engine.statecopy import live_page_numbers, live_rows, pages_needed
from hyrax.actors.model.state import ComponentSpec


@dataclass
class Backup:
    manifest: Manifest
    host_rows: dict[str, list[int]] | None  # host-pool rows per component, None for cpu_tensor
    payload: list | None = None  # exported shards (object-store refs) from another replica


class Retractor:
    def __init__(self, components: tuple[ComponentSpec, ...], config: EngineConfig, executor,
                 allocators: dict[str, IndexAllocator], host_allocators: dict[str, IndexAllocator],
                 stats: EngineStats, release=None):
        self.components = components
        # the engine's one free point (deferred past the step in flight); direct by default
        self.release = release or (lambda owner, indices: [self.alloc[n].free(owner, i) for n, i in indices.items()])
        self.config = config
        self.executor = executor
        self.alloc = allocators
        self.host_alloc = host_allocators
        self.stats = stats
        self.verify = not config.faults.disable_verification

    # ---- indices ---------------------------------------------------------------------
    def free_device(self, req: Request) -> None:
        owned = {c.name: [i for i in req.indices.get(c.name, []) if i >= 0] for c in self.components}
        self.release(req.id, {n: i for n, i in owned.items() if i})
        req.indices = {}

    def _allocate_live(self, req: Request, num_tokens: int, avoid: dict[str, set[int]] | None = None
                       ) -> dict[str, list[int]] | None:
        """New indices covering the live state of `num_tokens` tokens, or None if they do not
        fit; indices in `avoid` are taken only when nothing else is free."""
        ps = self.config.page_size
        need = {c.name: len(live_page_numbers(c, num_tokens, ps)) for c in self.components}
        if not all(self.alloc[c.name].can_allocate(need[c.name]) for c in self.components):
            return None
        out = {}
        for c in self.components:
            got = self.alloc[c.name].allocate(req.id, need[c.name], (avoid or {}).get(c.name, frozenset()))
            if c.paged:
                table = [-1] * pages_needed(c, num_tokens, ps)
                for n, page in zip(live_page_numbers(c, num_tokens, ps), got):
                    table[n] = page
                out[c.name] = table
            else:
                out[c.name] = got
        return out

    def rows(self, indices: dict[str, list[int]], num_tokens: int) -> dict[str, list[int]]:
        """The pool rows holding the live state of `num_tokens` tokens, per component."""
        return {c.name: live_rows(c, indices[c.name], num_tokens, self.config.page_size) for c in self.components}

    # ---- retract ---------------------------------------------------------------------
    def retract(self, req: Request, trigger: str, mode: str | None = None, hold: bool = False) -> str:
        """Back up (or drop) a running request's state and free its device indices.
        Returns the mode actually used."""
        mode = mode or self.config.retraction_backup
        t0 = time.perf_counter()
        backup = None
        if mode != "recompute":
            backup = self._backup(req, mode)
            if backup is None:
                mode = "recompute"
        self.free_device(req)  # only after every rank acknowledged its backup
        req.backup = backup
        if backup is None:
            req.num_computed = 0
        self.stats.retractions[(trigger, mode)] += 1
        self.stats.backup_seconds.append(time.perf_counter() - t0)
        return mode

    def make_manifest(self, req: Request, rows: dict[str, list[int]], sums: dict[int, dict[str, int]],
                      mode: str) -> Manifest:
        """A manifest of what the ranks reported; a component no rank reported is absent."""
        manifest = Manifest(req.id, req.num_computed, mode, num_ranks=len(sums))
        for c in self.components:
            per_rank = {r: s[c.name] for r, s in sums.items() if c.name in s}
            if per_rank:
                manifest.components[c.name] = ComponentRecord(
                    c.name, [i for i in req.indices[c.name] if i >= 0], len(rows[c.name]),
                    len(rows[c.name]) * c.row_bytes, per_rank)
        return manifest

    def _backup(self, req: Request, mode: str) -> Backup | None:
        n = req.num_computed
        rows = self.rows(req.indices, n)
        host_rows = None
        if mode == "host_pool":
            need = {c.name: len(rows[c.name]) for c in self.components}
            if not all(self.host_alloc[c.name].can_allocate(need[c.name]) for c in self.components):
                self.stats.host_pool_full += 1
                return None
            host_rows = {c.name: self.host_alloc[c.name].allocate(req.id, need[c.name]) for c in self.components}
        try:
            sums = self.executor.backup(req.id, rows, host_rows)
        except Exception:
            self._drop(req.id, host_rows)
            return None
        manifest = self.make_manifest(req, rows, sums, mode)
        for name, rec in manifest.components.items():
            self.stats.bytes_backed_up[name] += rec.bytes * len(rec.checksums)
        return Backup(manifest, host_rows)

    def _drop(self, req_id: str, host_rows: dict[str, list[int]] | None) -> None:
        try:
            self.executor.discard(req_id)
        finally:
            if host_rows:
                for name, idx in host_rows.items():
                    self.host_alloc[name].free(req_id, idx)

    def release_backup(self, req: Request) -> None:
        """Discard a retracted request's backup everywhere (abort, fallback, after restore)."""
        if req.backup is not None:
            if req.backup.payload is None:  # remote payloads live in the object store, not on ranks
                self._drop(req.id, req.backup.host_rows)
            req.backup = None

    # ---- restore ---------------------------------------------------------------------
    def restore(self, req: Request) -> Outcome:
        """Bring a retracted request's state back into the device pools. VERIFIED: it can run;
        RECOMPUTE / FALLBACK / CHECKSUM_MISMATCH: its state is dropped, it must be rebuilt by
        prefill; NO_CAPACITY: left as it was. The caller moves it in the request table."""
        backup: Backup | None = req.backup
        if backup is None:
            return self._to_recompute(req, Outcome.RECOMPUTE, count=False)
        m = backup.manifest
        # New memory, really: the allocator hands out the most recently freed index first,
        # which after a retract-then-restore would be the request's own old slot and pages,
        # still holding its bytes — a backup that left a component out would then look
        # lossless. Avoiding them whenever the pool has other room makes every restore
        # exercise the copy it claims to make.
        old = {name: set(rec.indices) for name, rec in m.components.items()} if backup.payload is None else None
        new = self._allocate_live(req, m.num_tokens, old)
        if new is None:
            return Outcome.NO_CAPACITY
        t0 = time.perf_counter()
        req.indices = new
        try:
            if self.verify:
                m.require_complete(self.components)
            if self.config.faults.restore_into_old_indices and backup.payload is None:
                target = self._rows_from_old(m)
            else:
                target = self.rows(new, m.num_tokens)
            if self.verify:
                self._check_owned(req, target)
            if backup.payload is None:
                sums = self.executor.restore(req.id, target, backup.host_rows)
                ok = all(sums.get(rank, {}).get(name) == expect
                         for name, rec in m.components.items() for rank, expect in rec.checksums.items())
            else:
                res = self.executor.import_(req.id, target, m.by_rank(), backup.payload)
                ok = all(isinstance(r.get(c.name), list) and r[c.name][0] == r[c.name][1]
                         for r in res.values() for c in self.components)
        except Exception:  # incomplete manifest, ownership, or a failed copy on any rank:
            self.free_device(req)  # never resume on partial state
            return self._to_recompute(req, Outcome.FALLBACK)
        if self.verify and not ok:
            self.stats.checksum_failures += 1
            self.free_device(req)
            return self._to_recompute(req, Outcome.CHECKSUM_MISMATCH)
        moved = self.stats.bytes_transferred if backup.payload is not None else self.stats.bytes_restored
        for name, rec in m.components.items():
            moved[name] += rec.bytes * len(rec.checksums)
            if backup.payload is not None:
                req.transferred_bytes[name] = req.transferred_bytes.get(name, 0) + rec.bytes * len(rec.checksums)
        self.release_backup(req)
        req.num_computed = m.num_tokens
        if backup.payload is None:  # imports are counted as transfers by the engine
            self.stats.restores[Outcome.VERIFIED.value] += 1
            self.stats.restore_seconds.append(time.perf_counter() - t0)
        return Outcome.VERIFIED

    def _rows_from_old(self, m: Manifest) -> dict[str, list[int]]:
        """Fault injection: the rows the request had before retraction."""
        ps = self.config.page_size
        out = {}
        for c in self.components:
            rec = m.components.get(c.name)
            old = rec.indices if rec else []
            if c.paged:
                table = [-1] * pages_needed(c, m.num_tokens, ps)
                for n, page in zip(live_page_numbers(c, m.num_tokens, ps), old):
                    table[n] = page
                old = table
            out[c.name] = live_rows(c, old, m.num_tokens, ps) if old else []
        return out

    def _check_owned(self, req: Request, rows: dict[str, list[int]]) -> None:
        """Restore may only write rows of indices the request owns now."""
        ps = self.config.page_size
        for c in self.components:
            owned = set(self.alloc[c.name].owned_by(req.id))
            units = {r // ps for r in rows[c.name]} if c.paged else set(rows[c.name])
            if not units <= owned:
                raise AllocationError(f"{req.id}: restore target of {c.name} is not owned by the request")

    def _to_recompute(self, req: Request, result: Outcome, count: bool = True) -> Outcome:
        if req.backup is not None and req.backup.payload is not None:
            count = False  # a failed import: counted as a transfer result, not a restore
            transfer = True
        else:
            transfer = False
        self.release_backup(req)
        req.num_computed = 0
        req.indices = {}
        if count:
            self.stats.restore_fallbacks += 1
        if not transfer:
            self.stats.restores[result.value] += 1
        return result
