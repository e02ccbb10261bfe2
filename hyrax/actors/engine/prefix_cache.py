"""Prefix cache for hybrid models: a radix tree over token ids at page granularity, one per
replica, owned by the coordinator (see docs/prefix-cache.md).

Every edge of the tree is a whole number of pages of tokens; a node holds, for the positions of
its edge:

- `full`: one page per edge page of every `token` component (shared by reference count with
  the requests that hit it: they read these pages and write their own from the node's end on);
- `window`: for every `window` component, the pages a hit needs (the component's live rows
  before the end of some checkpoint below; -1 where nothing needs the page);
- `checkpoint`: at a track boundary, the recurrent state after the node's last token — one
  slot per `slot` component in that component's checkpoint pool, and its checksums per rank
  (None at a split point, or where eviction took it from a node requests still lock).

A hit is the longest cached prefix that ends on a checkpoint. The tree never touches an
allocator: `insert` reports the units it adopted (the caller moves their ownership from the
request to `owner`), `evict` reports the units it let go (the caller frees them as `owner`).
`check_invariants(allocators)` verifies both sides agree.
"""
from __future__ import annotations

import itertools
from typing import Callable, Mapping, Sequence

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.prefix_checks import check_tree
from hyrax.actors.engine.prefix_evict import Eviction
from hyrax.actors.engine.statecopy import live_page_numbers
from hyrax.actors.model.components import SLOT, TOKEN, WINDOW, ComponentSpec

from hyrax.actors.engine.prefix_nodes import (  # noqa: F401 - the cache's public values, re-exported
    CACHE_OWNER, Checkpoint, InUse, Inserted, Match, Node, PrefixCacheError, Units, checkpoint_pool, give_back, transfer,
)


class PrefixCache(Eviction):
    def __init__(self, components: tuple[ComponentSpec, ...], page_size: int, owner: str = CACHE_OWNER):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size = page_size
        self.owner = owner
        self.tokens = tuple(c for c in components if c.kind == TOKEN)
        self.windows = tuple(c for c in components if c.kind == WINDOW)
        self.slots = tuple(c for c in components if c.kind == SLOT)
        self.pools = (*(c.name for c in self.tokens), *(c.name for c in self.windows),
                      *(checkpoint_pool(c.name) for c in self.slots))
        self._ids = itertools.count()
        self._clock = itertools.count(1)
        self.root = Node(next(self._ids), None, (), 0)

    # ---- queries -------------------------------------------------------------------------
    def nodes(self):
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def held(self) -> Units:
        """Every unit the tree holds, per pool."""
        out: Units = {p: [] for p in self.pools}
        for n in self.nodes():
            for pool, units in self._units(n):
                out[pool].extend(units)
        return out

    @staticmethod
    def _units(n: Node):
        """(pool, units) of everything node `n` holds."""
        yield from n.full.items()
        for name, pages in n.window.items():
            yield name, [p for p in pages if p >= 0]
        if n.checkpoint is not None:
            for name, slot in n.checkpoint.slots.items():
                yield checkpoint_pool(name), [slot]

    def match(self, token_ids: Sequence[int], accept: Callable[[Node], bool] | None = None,
              touch: bool = True) -> Match:
        """The longest cached prefix of `token_ids` that ends on a checkpoint (one `accept` takes,
        when given); touches it (LRU). A request passes its prompt without the last token: the
        hit must leave one to compute."""
        ps = self.page_size
        node, pos, path, best = self.root, 0, [], 0
        while pos + ps <= len(token_ids):
            child = node.children.get(tuple(token_ids[pos:pos + ps]))
            if child is None or tuple(token_ids[pos:pos + len(child.key)]) != child.key:
                break  # a partial edge holds no checkpoint
            node, pos = child, pos + len(child.key)
            path.append(node)
            if node.checkpoint is not None and (accept is None or accept(node)):
                best = len(path)
        if best == 0:
            return Match(0, None, {}, {}, None)
        path = path[:best]
        hit = path[-1]
        if touch:
            self._touch(hit)
        full = {c.name: tuple(p for n in path for p in n.full[c.name]) for c in self.tokens}
        window = {c.name: {k: self._window_page(path, c.name, k) for k in self._window_needs(c, hit.end)}
                  for c in self.windows}
        return Match(hit.end, hit, full, window, hit.checkpoint)

    # ---- references ------------------------------------------------------------------------
    def lock(self, node: Node) -> None:
        """A request uses the prefix ending at `node`: nothing on its path may be evicted."""
        if node.checkpoint is None:
            raise PrefixCacheError(f"{node!r}: only a node with a checkpoint can be locked")
        if node.parent is None:
            raise PrefixCacheError(f"{node!r}: evicted, no longer in the tree")
        node.locks += 1
        n: Node | None = node
        while n is not None:
            n.ref += 1
            n = n.parent

    def unlock(self, node: Node) -> Units:
        """Returns the units that went with the lock (the caller gives them back): a leaf whose
        checkpoint was evicted while it was locked (`evict` under window pressure) leaves with
        its last lock, as do ancestors left as leaves without a checkpoint."""
        if node.locks < 1:
            raise PrefixCacheError(f"{node!r}: unlocked more often than locked")
        node.locks -= 1
        n: Node | None = node
        while n is not None:
            n.ref -= 1
            n = n.parent
        if node.ref or node.children or node.checkpoint is not None or node.parent is None:
            return {}
        freed: Units = {p: [] for p in self.pools}
        self._remove(node, freed)
        return {p: u for p, u in freed.items() if u}

    # ---- insert ----------------------------------------------------------------------------
    def insert(self, token_ids: Sequence[int], full: Mapping[str, Sequence[int]],
               window: Mapping[str, Sequence[int]], checkpoints: Mapping[int, Checkpoint]) -> Inserted:
        """Cache a request's prefix up to its last checkpoint position.

        full / window: the request's page tables (page number -> unit, -1 where it holds none);
        checkpoints: position (a multiple of the page size) -> the request's checkpoint there.
        The insert follows the tree wherever it holds the request's tokens, whoever computed
        them, and grows the rest from the request's pages (adopted). Where the tree's pages on
        the path up to the returned node are not the request's own (it computed or restored
        them again), `Inserted.reuse` names them: the request reads those instead and gives its
        copies back, so that the lock it takes on the node covers exactly what it reads - never
        a copy it does not read, pinned for as long as it runs. Window pages the tree already
        holds are not taken (the request keeps its own); a checkpoint already cached, or one
        whose window rows the request has released, is rejected and stays with the caller."""
        ps = self.page_size
        if not checkpoints:
            raise ValueError("insert needs at least one checkpoint (a hit must end on one)")
        cuts = sorted(checkpoints)
        end = cuts[-1]
        if any(p <= 0 or p % ps or p > len(token_ids) for p in cuts):
            raise ValueError(f"checkpoint positions must be multiples of {ps} in (0, {len(token_ids)}]: {cuts}")
        for c in self.tokens:
            table = full[c.name]
            if len(table) < end // ps or any(u < 0 for u in table[:end // ps]):
                raise ValueError(f"{c.name}: the page table does not cover positions 0..{end - 1}")
        for p, ck in checkpoints.items():
            if set(ck.slots) != {c.name for c in self.slots}:
                raise ValueError(f"checkpoint at {p} has slots for {sorted(ck.slots)}, "
                                 f"the model has {sorted(c.name for c in self.slots)}")
        adopted: Units = {p: [] for p in self.pools}
        rejected: list[int] = []
        node, pos, path = self.root, 0, []
        for cut in cuts:
            while pos < cut:
                child = node.children.get(tuple(token_ids[pos:pos + ps]))
                if child is None:
                    child = self._grow(node, token_ids, pos, cut, full, adopted)
                else:
                    m = self._common(child.key, token_ids, pos, cut - pos)
                    if m < len(child.key):
                        child = self._split(child, m)
                node, pos = child, child.end
                path.append(node)
            if node.checkpoint is not None or not self._adopt_window(path, window, adopted):
                rejected.append(cut)
                continue
            node.checkpoint = checkpoints[cut]
            for name, slot in checkpoints[cut].slots.items():
                adopted[checkpoint_pool(name)].append(slot)
        node = self._prune(node, adopted)
        self._touch(node)
        last = node if node.checkpoint is not None else self._deepest_checkpoint(node)
        return Inserted(last, last.end, {p: u for p, u in adopted.items() if u}, tuple(rejected),
                        self._reuse(last, full))

    def _reuse(self, node: Node, full: Mapping[str, Sequence[int]]) -> dict[str, dict[int, int]]:
        """Per token component, {page number: the tree's unit} where the path down to `node` holds
        a page the request's table does not (it computed that page again in one of its own)."""
        path = self._path(node)
        out = {}
        for c in self.tokens:
            table = full[c.name]
            tree = [u for n in path for u in n.full[c.name]]
            diff = {k: u for k, u in enumerate(tree) if table[k] != u}
            if diff:
                out[c.name] = diff
        return out

    def _grow(self, parent: Node, token_ids, pos: int, cut: int, full, adopted: Units) -> Node:
        ps = self.page_size
        n = Node(next(self._ids), parent, tuple(token_ids[pos:cut]), pos)
        pages = range(pos // ps, cut // ps)
        for c in self.tokens:
            n.full[c.name] = [full[c.name][k] for k in pages]
            adopted[c.name].extend(n.full[c.name])
        for c in self.windows:
            n.window[c.name] = [-1] * len(pages)
        parent.children[n.key[:ps]] = n
        return n

    def _prune(self, node: Node, adopted: Units) -> Node:
        """Drop a newly grown tail that ended up without a checkpoint (its last one was
        rejected): nothing could ever hit it. Its pages go back to the request."""
        while node is not self.root and not node.children and node.checkpoint is None and node.ref == 0:
            for name, pages in node.full.items():
                gone = set(pages)
                adopted[name] = [u for u in adopted[name] if u not in gone]
            parent = node.parent
            del parent.children[node.key[:self.page_size]]
            node.parent = None
            node = parent
        return node

    def _common(self, key: tuple[int, ...], token_ids, pos: int, limit: int) -> int:
        """Length of the common prefix of `key` and token_ids[pos:], in whole pages, at most `limit`."""
        ps, m = self.page_size, 0
        while m < min(len(key), limit) and tuple(token_ids[pos + m:pos + m + ps]) == key[m:m + ps]:
            m += ps
        return m

    def _split(self, child: Node, m: int) -> Node:
        """Cut `child`'s edge after `m` tokens; returns the new upper node (it ends at start + m)."""
        ps, k = self.page_size, m // self.page_size
        parent = child.parent
        top = Node(next(self._ids), parent, child.key[:m], child.start)
        top.full = {n: u[:k] for n, u in child.full.items()}
        top.window = {n: u[:k] for n, u in child.window.items()}
        child.full = {n: u[k:] for n, u in child.full.items()}
        child.window = {n: u[k:] for n, u in child.window.items()}
        top.ref, top.last_access = child.ref, child.last_access
        parent.children[top.key[:ps]] = top
        child.key, child.start, child.parent = child.key[m:], child.start + m, top
        top.children = {child.key[:ps]: child}
        return top

    def _adopt_window(self, path: list[Node], window: Mapping[str, Sequence[int]], adopted: Units) -> bool:
        """Make the tree hold every window page a hit at path[-1].end needs, taking missing ones
        from the request's tables; False (and nothing taken) if the request lacks one."""
        end, take = path[-1].end, []
        for c in self.windows:
            table = window.get(c.name, ())
            for k in self._window_needs(c, end):
                node, j = self._locate(path, k)
                if node.window[c.name][j] < 0:
                    if k >= len(table) or table[k] < 0:
                        return False
                    take.append((c.name, node, j, table[k]))
        for name, node, j, unit in take:
            node.window[name][j] = unit
            adopted[name].append(unit)
        return True

    def _locate(self, path: list[Node], page: int) -> tuple[Node, int]:
        pos = page * self.page_size
        for n in reversed(path):
            if n.start <= pos < n.end:
                return n, (pos - n.start) // self.page_size
        raise PrefixCacheError(f"page {page} is not on the path")

    def _window_page(self, path: list[Node], name: str, page: int) -> int:
        node, j = self._locate(path, page)
        return node.window[name][j]

    def _window_needs(self, comp: ComponentSpec, end: int) -> list[int]:
        return live_page_numbers(comp, end, self.page_size)

    def _path(self, node: Node) -> list[Node]:
        """The nodes from the root's child down to `node` (empty for the root)."""
        path = []
        n: Node | None = node
        while n is not None and n is not self.root:
            path.append(n)
            n = n.parent
        return path[::-1]

    def _deepest_checkpoint(self, node: Node) -> Node:
        while node.checkpoint is None and node.parent is not None:
            node = node.parent
        return node

    def _touch(self, node: Node) -> None:
        t = next(self._clock)
        n: Node | None = node
        while n is not None:
            n.last_access = t
            n = n.parent

    def check_invariants(self, allocators: Mapping[str, IndexAllocator] | None = None,
                         leaving: Mapping[str, list[int]] | None = None) -> None:
        """Structure, reference counts and window rows; with `allocators` (pool name -> its
        allocator) also that the tree owns exactly the units it holds (and `leaving`, freed
        after the step in flight) and every pool balances."""
        check_tree(self, allocators, leaving)
