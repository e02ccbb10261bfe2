"""The prefix cache as the engine drives it (the tree: prefix_cache.py; track boundaries:
mamba_track.py; the design: docs/prefix-cache.md).

- `attach`: a waiting request matches the tree; a hit's node is locked, its full-attention
  pages put at the head of the request's page table (owned by the cache, `CacheHold.shared`)
  and its computed length set to the hit's.
- `prepare(plan)`: the plan's admitted hits copy the cached window pages and checkpoint into
  the request's own units before the forward, each checkpoint with the hashes it had when it was
  cached: every rank checks them before the step writes anything (a mismatch fails the step
  before it wrote: `revoke` below); every track boundary an entry reaches carries a
  `CheckpointWrite` (the step's snapshot of where the recurrent state goes, in checkpoint slots
  taken for that write alone).
- `commit(plan, result)`: from that snapshot only, the written checkpoints are committed and
  handed to the tree with the request's pages (`insert`); what the tree adopts changes owner,
  a checkpoint it already has is freed, and pages the tree holds that the request computed
  again in its own are read from the tree from then on (its copies freed: `_reuse`).
- `detach`: a request that leaves (finish, retraction, hand-off) unlocks its node and frees the
  slots of its pending writes through the engine's one free point; it never frees a unit the
  cache owns.
- `evict(short)`: least recently used unreferenced nodes go before any request is retracted;
  for a short window pool, then checkpoints on locked paths whose window pages no request reads
  any more (`InUse`: what requests read, which only this layer knows).
- `revoke(ids)`: hits whose checkpoint changed since it was cached (the step raised
  `CheckpointMismatch`) never count as hits (a hit counts once the step with its copies
  commits), and their nodes are never matched again; each goes from the tree as soon as no
  request holds it. The engine rebuilds the step's requests.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Mapping

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.lifecycle import RequestTable
from hyrax.actors.engine.mamba_track import CheckpointSlots, MambaTrack, TrackPolicy, TrackState, TrackWrite
from hyrax.actors.engine.plan import CheckpointWrite, StepPlan, StepResult, UnitCopy
from hyrax.actors.engine.pools import PoolSizes, checkpoint_pools
from hyrax.actors.engine.prefix_cache import (
    CACHE_OWNER, Checkpoint, InUse, Match, Node, PrefixCache, checkpoint_pool, transfer,
)
from hyrax.actors.engine.request import Request, State
from hyrax.actors.engine.stats import PrefixCacheStats
from hyrax.actors.model.components import SLOT, TOKEN, WINDOW, ComponentSpec, captures_mid_step

MIN_CHECKPOINTS = 2  # checkpoint slots a pool needs at least: one cached, one being written


@dataclass
class CacheHold:
    """What a request holds of the cache: the node it locked (every unit of its tables the
    cache owns lies at or above it), those units, a hit whose copies are still to be made, and
    its track (the checkpoint writes planned and not yet committed)."""

    node: Node | None = None
    shared: dict[str, set[int]] = field(default_factory=dict)
    hit: Match | None = None
    track: TrackState | None = None

    def owns(self, pool: str, unit: int) -> bool:
        return unit not in self.shared.get(pool, ())


class PrefixCaching:
    def __init__(self, components: tuple[ComponentSpec, ...], config: EngineConfig, sizes: PoolSizes,
                 alloc: dict[str, IndexAllocator], release: Callable[[str, dict[str, list[int]]], None],
                 stats: PrefixCacheStats):
        self.components = components
        self.slots = tuple(c for c in components if c.kind == SLOT)
        self.paged = frozenset(c.name for c in components if c.paged)
        self.windows = frozenset(c.name for c in components if c.kind == WINDOW)
        self.enabled = config.caches_prefixes
        if self.enabled and self.slots and sizes.checkpoints < MIN_CHECKPOINTS:
            raise ValueError(f"the prefix cache needs checkpoint pools of >= {MIN_CHECKPOINTS} slots; "
                             f"the pool sizes give {sizes.checkpoints} (size them with pool_sizes_for)")
        self.ckpt_pools = checkpoint_pools(components, sizes)
        self.alloc = alloc  # the engine's allocators, the checkpoint pools among them
        for name in self.ckpt_pools:
            alloc[name] = IndexAllocator(name, sizes.checkpoints)
        self.policy = TrackPolicy(config.mamba_track_interval, config.page_size,
                                  inside=not config.deterministic and captures_mid_step(components))
        self.track = MambaTrack(self.policy)
        self.deterministic = config.deterministic
        self.prefill_chunk = config.prefill_chunk
        self.release = release  # the engine's one free point
        self.stats = stats
        self.tree = PrefixCache(components, config.page_size)
        self._hits: set[str] = set()  # requests holding a hit whose copies no plan has made yet
        self._hit_of: dict[str, tuple[Node, int]] = {}  # request -> its hit (node, tokens), until it leaves
        # hits whose first step has not committed yet: counted then (a revoked one never is, and
        # the exported counters only ever grow)
        self._uncounted: set[str] = set()
        self._corrupt: set[Node] = set()  # nodes a check condemned, held by some request still
        # requests whose window tables hold pages the tree took at an insert (rows they may still read)
        self._readers: dict[str, Request] = {}
        for pool in self.tree.pools if self.enabled else ():
            stats.evicted[pool] += 0  # every pool has a sample from the start

    # ---- a waiting request asks the cache -------------------------------------------------
    def attach(self, waiting: Iterable[Request]) -> None:
        if not self.enabled:
            return
        for req in waiting:
            if req.cache is None and req.num_computed == 0 and req.backup is None:
                req.cache = CacheHold()
                self._match(req)

    def _match(self, req: Request) -> None:
        ids = req.all_ids
        self.stats.query_tokens += len(ids)
        m = self.tree.match(ids[:-1], self._accept(req))
        if not m.length:
            return
        self.tree.lock(m.node)
        hold = req.cache
        hold.node, hold.hit = m.node, m
        self._hits.add(req.id)
        self._hit_of[req.id] = (m.node, m.length)
        self._uncounted.add(req.id)
        for name, pages in m.full.items():
            req.indices[name] = tuple(pages)
            hold.shared[name] = set(pages)
        req.num_computed = m.length

    def peek(self, token_ids: list[int]) -> int:
        """The hit length a request with this prompt would get (the LRU order is left alone)."""
        if not self.enabled or len(token_ids) < 2:
            return 0
        return self.tree.match(token_ids[:-1], self._accept_for(len(token_ids)), touch=False).length

    def revoke(self, req_ids: Iterable[str]) -> None:
        """These requests' hits failed their check on a rank (`CheckpointMismatch`: the step
        wrote nothing): they never count as hits, and their nodes are never matched again."""
        for rid in req_ids:
            hit = self._hit_of.get(rid)
            if hit is None:
                continue
            self.stats.corrupt += 1
            self._uncounted.discard(rid)
            self._corrupt.add(hit[0])

    def _accept(self, req: Request) -> Callable[[Node], bool] | None:
        return self._accept_for(req.num_prompt)

    def _accept_for(self, num_prompt: int) -> Callable[[Node], bool] | None:
        """Deterministic mode takes a checkpoint only where the request's own chunk schedule cuts
        and only one taken while prefilling a prompt: the state is then bit-identical to the one
        the request would compute itself. A condemned node (`revoke`) is never taken."""
        corrupt = self._corrupt
        if not self.deterministic:
            return (lambda node: node not in corrupt) if corrupt else None
        cuts = self.policy.deterministic_cuts(num_prompt, num_prompt, self.prefill_chunk)
        return lambda node: node.checkpoint.in_prompt and node.end in cuts and node not in corrupt

    # ---- a plan's copies and checkpoint writes ---------------------------------------------
    def prepare(self, plan: StepPlan, table: RequestTable) -> StepPlan:
        if not self.enabled or not plan.entries:
            return plan
        copies: list[UnitCopy] = []
        writes: list[CheckpointWrite] = []
        get, is_boundary, writes_at, hits = table.requests.get, self.policy.is_boundary, self.policy.writes_at, self._hits
        for e in plan.entries:
            if len(e.token_ids) == 1 and e.sample is not None and e.req_id not in hits:
                # a decode token (its prompt is the length before it less its draws) that ends
                # on no boundary: no write, decided without reading the request
                end = e.start + 1
                if not is_boundary(end, end - e.sample.draw):
                    continue
            req = get(e.req_id)
            hold = req.cache
            if hold is None:
                hold = req.cache = CacheHold()
            if hold.hit is not None:
                copies.extend(self._hit_copies(req, hold.hit))
                hold.hit = None
                hits.discard(req.id)
            end = e.start + len(e.token_ids)
            if not is_boundary(end, req.num_prompt) and (len(e.token_ids) == 1 or not writes_at(e.start, end, req.num_prompt)):
                continue  # most decode steps: no write (the check `_plan_track` starts with)
            prompt_end = self.policy.prompt_end(req.num_prompt)
            writes.extend(CheckpointWrite(req.id, w.position, tuple((n, req.indices[n][0], s) for n, s in w.slots.units),
                                          w.position <= prompt_end)
                          for w in self._plan_track(req, hold, e.start, end))
        if not copies and not writes:
            return plan
        return replace(plan, copies=tuple(copies), checkpoints=tuple(writes))

    def _hit_copies(self, req: Request, m: Match) -> list[UnitCopy]:
        out = []
        for name, pages in m.window.items():
            if pages:
                nums = sorted(pages)
                out.append(UnitCopy(name, tuple(pages[k] for k in nums), name,
                                    tuple(req.indices[name][k] for k in nums)))
        for name, slot in (m.checkpoint.slots.items() if m.checkpoint else ()):
            expect = tuple(sorted(m.checkpoint.checksums.get(name, {}).items()))  # what each rank recorded
            out.append(UnitCopy(checkpoint_pool(name), (slot,), name, (req.indices[name][0],), req.id, expect))
        return out

    def _plan_track(self, req: Request, hold: CacheHold, start: int, end: int) -> tuple[TrackWrite, ...]:
        """The writes of a step running start..end-1 (`TrackPolicy.writes_at`), each with slots
        taken for it alone. Other steps leave the track alone (no per-request work on most decode
        steps): the next boundary's plan covers every position since the last one."""
        if not self.policy.writes_at(start, end, req.num_prompt):
            return ()
        if hold.track is None:  # the track starts at the first boundary a request reaches
            hold.track = self.track.start(start)
        skipped = hold.track.skipped
        hold.track, ws = self.track.plan(hold.track, req.id, hold.track.planned, end, req.num_prompt,
                                         lambda n: self._take(req.id, n))
        self.stats.checkpoints_skipped += hold.track.skipped - skipped
        return ws

    def _take(self, owner: str, n: int) -> list[CheckpointSlots]:
        """Up to `n` sets of one slot of every checkpoint pool for `owner` (evicting cache if
        needed): as many as the pools can give."""
        pools = [checkpoint_pool(c.name) for c in self.slots]
        short = {p: n - self.alloc[p].num_free for p in pools if self.alloc[p].num_free < n}
        if short:
            self.evict(short)
        k = min([n] + [self.alloc[p].num_free for p in pools])
        if k <= 0:
            return []
        got = {c.name: self.alloc[checkpoint_pool(c.name)].allocate(owner, k) for c in self.slots}
        return [CheckpointSlots.of({name: units[j] for name, units in got.items()}) for j in range(k)]

    # ---- results: commit checkpoints, hand them to the tree -------------------------------
    def commit(self, plan: StepPlan, result: StepResult, table: RequestTable) -> None:
        """Reads the plan's checkpoint writes (the step's snapshot), never live request fields:
        each request's written checkpoints go to the tree in one insert. A hit counts once the
        step that made its copies committed (its check passed on every rank)."""
        if self._uncounted:
            for rid in self._uncounted.intersection(plan.req_ids):
                self._uncounted.discard(rid)
                self.stats.hits += 1
                self.stats.hit_tokens += self._hit_of[rid][1]
        done: dict[str, list[TrackWrite]] = {}
        for cw in plan.checkpoints:
            req = table.get(cw.req_id)
            hold = req.cache if req is not None and req.state == State.RUNNING else None
            if hold is None or hold.track is None:
                continue  # it left while the step ran: its slots are freed with the rest
            w = TrackWrite(cw.req_id, cw.position, CheckpointSlots.of({n: s for n, _, s in cw.slots}))
            if w not in hold.track.pending:
                continue
            hold.track, w = self.track.commit(hold.track, w)
            done.setdefault(cw.req_id, []).append(w)
        for rid, ws in done.items():
            self._donate(table.get(rid), ws, result.checkpoints)

    def _donate(self, req: Request, ws: list[TrackWrite], sums: dict) -> None:
        """Insert the request's prefix up to its last written checkpoint, with every checkpoint
        this step wrote; slots of a checkpoint the tree already has go back to the pool."""
        hold, prompt_end = req.cache, self.policy.prompt_end(req.num_prompt)
        cks = {w.position: Checkpoint(w.slots.as_dict(), {n: dict(sums.get((w.req_id, w.position), {}).get(n, {}))
                                                          for n, _ in w.slots.units}, w.position <= prompt_end)
               for w in ws}
        tables = {c.name: req.indices[c.name] for c in self.components if c.kind in (TOKEN, WINDOW)}
        ins = self.tree.insert(req.all_ids[:max(cks)], tables, tables, cks)
        for position in ins.rejected:
            for name, slot in cks[position].slots.items():
                self.alloc[checkpoint_pool(name)].free(req.id, [slot])
        self.stats.checkpoints += len(cks) - len(ins.rejected)
        transfer(self.alloc, ins.adopted, req.id, CACHE_OWNER)
        for pool, units in ins.adopted.items():
            if pool in self.paged:
                hold.shared.setdefault(pool, set()).update(units)
            if pool in self.windows:
                self._readers[req.id] = req
        # the lock only moves down the request's path: the node it holds covers every cached unit
        # in its tables (an insert that stopped above it, PrefixCache.insert, leaves it there)
        if ins.node.checkpoint is not None and ins.node.parent is not None and (
                hold.node is None or ins.length > hold.node.end):
            self.tree.lock(ins.node)
            if hold.node is not None:
                self._let_go(self.tree.unlock(hold.node))
            hold.node = ins.node
        if ins.reuse and hold.node is not None and ins.length <= hold.node.end:  # under its lock
            self._reuse(req, ins.reuse)

    def _reuse(self, req: Request, reuse: Mapping[str, Mapping[int, int]]) -> None:
        """The request computed pages the tree holds again in its own: it reads the tree's from
        now on (on the path of the node it locks) and its copies go back through the one free
        point (the step in flight may still read them: it was planned with the old table)."""
        hold, mine = req.cache, {}
        for name, pages in reuse.items():
            table = list(req.indices[name])
            mine[name] = [table[k] for k in pages if hold.owns(name, table[k])]
            for k, unit in pages.items():
                table[k] = unit
            req.indices[name] = tuple(table)  # a new table: one a view or plan holds never changes
            hold.shared.setdefault(name, set()).update(pages.values())
        self.release(req.id, mine)

    # ---- a request leaves ------------------------------------------------------------------
    def detach(self, req: Request) -> None:
        """Unlock the request's node and free its pending writes' checkpoint slots (through the
        one free point: the step in flight may still write them);
        the cache's units in its tables stay the cache's."""
        hold, req.cache = req.cache, None
        self._hits.discard(req.id)
        self._hit_of.pop(req.id, None)
        self._uncounted.discard(req.id)
        self._readers.pop(req.id, None)
        if hold is None:
            return
        if hold.node is not None:
            self._let_go(self.tree.unlock(hold.node))  # a node whose checkpoint went leaves with it
            if hold.node in self._corrupt:  # condemned: it goes once nobody holds it
                self._drop_corrupt()
        if hold.track is not None:
            slots: dict[str, list[int]] = {}
            for pending in self.track.release(hold.track):
                for name, unit in pending.units:
                    slots.setdefault(checkpoint_pool(name), []).append(unit)
            self.release(req.id, slots)

    def owned(self, req: Request, name: str, units: Iterable[int]) -> list[int]:
        """The units of `units` the request owns (not the cache's)."""
        hold = req.cache
        return [u for u in units if u >= 0 and (hold is None or hold.owns(name, u))]

    # ---- memory ----------------------------------------------------------------------------
    def evict(self, short: dict[str, int]) -> bool:
        """Evict least recently used unreferenced nodes until `short` (pool -> units) is met or
        nothing more can go. True if anything was let go (free now, or after the step in flight)."""
        need = {p: n for p, n in short.items() if p in self.tree.pools and n > 0}
        if not self.enabled or not need:
            return False
        return bool(self._let_go(self.tree.evict(need, self._in_use())))

    def _in_use(self) -> InUse:
        """What requests still read of the tree beyond the token pages of the paths they lock:
        the checkpoints of hits not copied yet or in a step not committed yet, and the cached
        window pages still in some request's window table (a page leaves the table, set to -1,
        once its rows have left the window: `Results.release_windows`)."""
        hits = frozenset(self._hit_of[rid][0] for rid in self._hits | self._uncounted if rid in self._hit_of)
        window: dict[str, set[int]] = {}
        for req in self._readers.values():
            hold = req.cache
            for name in self.windows:
                shared = hold.shared.get(name) if hold is not None else None
                if shared:
                    window.setdefault(name, set()).update(u for u in req.indices.get(name, ()) if u in shared)
        return InUse(hits, {name: frozenset(units) for name, units in window.items()})

    def flush(self) -> dict[str, int]:
        """Evict everything no request uses; returns units freed per pool."""
        self.stats.flushes += 1
        return {p: len(u) for p, u in self._let_go(self.tree.flush()).items()}

    def _let_go(self, freed: dict[str, list[int]]) -> dict[str, list[int]]:
        """Units the tree let go return to their pools through the one free point: now, or once
        the step in flight (which may still read them) is committed."""
        if not freed:
            return freed
        self.release(CACHE_OWNER, freed)
        for pool, units in freed.items():
            self.stats.evicted[pool] += len(units)
        for req in self._readers.values():  # a page the tree let go is no longer the cache's in their tables
            hold = req.cache
            for pool in self.windows.intersection(freed):
                if hold is not None and pool in hold.shared:
                    hold.shared[pool].difference_update(freed[pool])
        return freed

    def _drop_corrupt(self) -> None:
        """Remove the condemned nodes nobody holds (and forget those already evicted)."""
        for node in list(self._corrupt):
            if node.parent is None:
                self._corrupt.discard(node)
            elif self._let_go(self.tree.drop(node) or {}) or node.parent is None:
                self._corrupt.discard(node)

    def cached(self) -> dict[str, int]:
        """Units the cache holds, per pool."""
        return {p: len(u) for p, u in self.tree.held().items()}

    def reset(self, requests: Iterable[Request]) -> None:
        """The ranks were replaced with empty pools: the tree is gone (its allocators are rebuilt
        by the engine), and no request holds anything of it."""
        self.tree = PrefixCache(self.components, self.tree.page_size)
        self._hits.clear()
        self._hit_of.clear()
        self._uncounted.clear()
        self._corrupt.clear()
        self._readers.clear()
        for req in requests:
            req.cache = None

    def check(self, leaving: dict[str, list[int]] | None = None) -> None:
        """The tree's invariants; `leaving`: units it let go whose free waits for the step in flight."""
        if not self.enabled:
            if self.tree.root.children:
                raise AssertionError("the prefix cache is off but its tree holds prefixes")
            return
        self.tree.check_invariants(self.alloc, leaving)  # also checks each pool the tree holds units of
