"""A replica's worth of prefix-cache bookkeeping for tests: real IndexAllocators, the real
PrefixCache and MambaTrack policy, and pool contents kept as Python values so a hit can be
checked against what the request would have computed itself.

Contents stand for the bytes a forward writes: a full/window page holds the (position, token)
pairs of its rows, a checkpoint slot holds the token prefix its state summarises. A unit's
content is wiped when it is freed, so a tree that keeps using a freed unit is caught.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.mamba_track import TrackPolicy
from hyrax.actors.engine.prefix_cache import (
    CACHE_OWNER, Checkpoint, InUse, PrefixCache, checkpoint_pool, give_back, transfer,
)
from hyrax.actors.engine.statecopy import live_page_numbers
from hyrax.actors.model.components import SLOT, TOKEN, WINDOW, ComponentSpec


def components(window: int = 24) -> tuple[ComponentSpec, ...]:
    def spec(name, kind, w=None):
        return ComponentSpec(name=name, kind=kind, layers=(0,), unit_shape=(2,), dtype=torch.float32, shard_dim=0,
                             shard_index=(0, 1), global_size=2, window=w)
    return (spec("full_kv", TOKEN), spec("swa_kv", WINDOW, window), spec("mamba_conv", SLOT),
            spec("mamba_ssm", SLOT))


@dataclass
class Held:
    """What one request holds: its own units, the cached node it locked, and its window table
    (page number -> unit; the tree may have taken some of them)."""

    ids: tuple[int, ...]
    hit: int
    own: dict[str, list[int]] = field(default_factory=dict)
    locked: list = field(default_factory=list)
    window: list[int] = field(default_factory=list)


class World:
    def __init__(self, page_size: int = 4, interval: int = 8, window: int = 10, pages: int = 64, ckpt_slots: int = 32):
        self.comps = components(window)
        self.ps = page_size
        self.policy = TrackPolicy(interval, page_size)
        self.cache = PrefixCache(self.comps, page_size)
        self.alloc = {p: IndexAllocator(p, ckpt_slots if p.endswith(".checkpoint") else pages)
                      for p in self.cache.pools}
        self.content: dict[tuple[str, int], object] = {}
        self.requests: dict[str, Held] = {}
        self.window = next(c for c in self.comps if c.kind == WINDOW)
        self.slot_names = [c.name for c in self.comps if c.kind == SLOT]

    # ---- a request's life ------------------------------------------------------------------
    def fits(self, ids) -> bool:
        n = -(-len(ids) // self.ps)
        return all(a.num_free >= n + 2 for a in self.alloc.values())

    def run(self, rid: str, ids: tuple[int, ...]) -> Held:
        """Admit `ids`, hit the cache, "prefill" the rest, insert every checkpoint, keep running."""
        m = self.cache.match(ids[:-1])
        h = Held(tuple(ids), m.length)
        self.requests[rid] = h
        if m.node is not None:
            self.cache.lock(m.node)
            h.locked.append(m.node)
            self.verify_hit(ids, m)
        n_pages = -(-len(ids) // self.ps)
        full = list(m.full.get("full_kv", ()))
        own_full = self.alloc["full_kv"].allocate(rid, n_pages - len(full))
        full += own_full
        h.own["full_kv"] = list(own_full)
        # window: the request's own pages for every page it touches (hit rows copied into them)
        own_w = self.alloc["swa_kv"].allocate(rid, n_pages)
        h.own["swa_kv"] = list(own_w)
        h.window = list(own_w)
        for k, unit in enumerate(own_w):
            src = m.window.get("swa_kv", {}).get(k)
            if k * self.ps < m.length and src is None:
                continue  # rows before the hit's window: never read again
            self.content[("swa_kv", unit)] = self.page_rows(ids, k)
        for k in range(len(m.full.get("full_kv", ())), n_pages):
            self.content[("full_kv", full[k])] = self.page_rows(ids, k)
        checkpoints = {}
        for pos in range(m.length + self.ps, len(ids) + 1, self.ps):
            if not self.policy.is_boundary(pos, len(ids)):
                continue
            slots = {n: self.alloc[checkpoint_pool(n)].allocate(rid, 1)[0] for n in self.slot_names}
            for n, s in slots.items():
                self.content[(checkpoint_pool(n), s)] = tuple(ids[:pos])
                h.own.setdefault(checkpoint_pool(n), []).append(s)
            checkpoints[pos] = Checkpoint(slots, {n: {0: hash(tuple(ids[:pos]))} for n in slots})
        window = {"swa_kv": own_w}
        if checkpoints:
            ins = self.cache.insert(ids, {"full_kv": full}, window, checkpoints)
            transfer(self.alloc, ins.adopted, rid, CACHE_OWNER)
            for pool, units in ins.adopted.items():
                taken = set(units)
                h.own[pool] = [u for u in h.own.get(pool, []) if u not in taken]
            if ins.length:
                self.cache.lock(ins.node)
                h.locked.append(ins.node)
            for k, unit in ins.reuse.get("full_kv", {}).items():  # read the tree's copy, free its own
                assert ins.length and self.content.get(("full_kv", unit)) == self.page_rows(ids, k)
                self.free("full_kv", [full[k]], rid)
                h.own["full_kv"].remove(full[k])
                full[k] = unit
        return h

    def finish(self, rid: str) -> None:
        h = self.requests.pop(rid)
        for pool, units in h.own.items():
            self.free(pool, units, rid)
        for node in h.locked:
            self.let_go(self.cache.unlock(node))

    def reads(self, h: Held) -> list[int]:
        """The window units a running request reads: those of its live rows after its last token
        (the rows before them it no longer reads, also where the tree took their pages)."""
        return [h.window[k] for k in live_page_numbers(self.window, len(h.ids), self.ps)]

    def in_use(self) -> InUse:
        """What the running requests read (a hit's copies are made at once here)."""
        return InUse(frozenset(), {"swa_kv": frozenset(u for h in self.requests.values() for u in self.reads(h))})

    def evict(self, need=None) -> dict[str, list[int]]:
        freed = self.cache.evict(need, self.in_use()) if need is not None else self.cache.flush()
        self.let_go(freed)
        return freed

    def let_go(self, freed: dict[str, list[int]]) -> None:
        for pool, units in freed.items():
            for u in units:
                self.content.pop((pool, u), None)
        give_back(self.alloc, freed)

    def free(self, pool, units, owner):
        for u in units:
            self.content.pop((pool, u), None)
        self.alloc[pool].free(owner, list(units))

    # ---- checks ---------------------------------------------------------------------------
    def page_rows(self, ids, k):
        return tuple((p, ids[p]) for p in range(k * self.ps, min((k + 1) * self.ps, len(ids))))

    def verify_hit(self, ids, m) -> None:
        """Everything a hit hands out holds what the request would have computed itself."""
        assert m.length % self.ps == 0 and 0 < m.length < len(ids)
        assert len(m.full["full_kv"]) == m.length // self.ps
        for k, unit in enumerate(m.full["full_kv"]):
            assert self.content.get(("full_kv", unit)) == self.page_rows(ids, k), f"full page {k} of the hit"
        needed = live_page_numbers(self.window, m.length, self.ps)
        assert sorted(m.window["swa_kv"]) == needed
        for k, unit in m.window["swa_kv"].items():
            assert self.content.get(("swa_kv", unit)) == self.page_rows(ids, k), f"window page {k} of the hit"
        for n, slot in m.checkpoint.slots.items():
            assert self.content.get((checkpoint_pool(n), slot)) == tuple(ids[:m.length]), f"{n} checkpoint"

    def check(self) -> None:
        self.cache.check_invariants(self.alloc)
        for a in self.alloc.values():
            a.check()
        for h in self.requests.values():  # nothing a running request reads was freed
            for k, unit in zip(live_page_numbers(self.window, len(h.ids), self.ps), self.reads(h)):
                assert self.content.get(("swa_kv", unit)) == self.page_rows(h.ids, k), f"window page {k} it reads"

    def drained(self) -> bool:
        """Evict everything unreferenced; then whether every pool is back at its baseline."""
        self.evict()
        self.check()
        return self.at_baseline()

    def at_baseline(self) -> bool:
        return all(a.num_free == a.capacity for a in self.alloc.values())


def cached_prefixes(cache) -> set[tuple[int, ...]]:
    """The token prefixes the tree holds a checkpoint for."""
    return {p for n, p in _prefixes(cache) if n.checkpoint is not None}


def node_ends(cache) -> set[tuple[int, ...]]:
    """The token prefixes a node of the tree ends on (checkpoints and split points)."""
    return {p for _, p in _prefixes(cache)}


def _prefixes(cache):
    for n in cache.nodes():
        keys, a = [], n
        while a is not cache.root:
            keys.append(a.key)
            a = a.parent
        yield n, tuple(t for k in reversed(keys) for t in k)
