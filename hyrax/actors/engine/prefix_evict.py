"""Eviction from the prefix cache: least recently used unreferenced nodes leave with every
component together, and window pages only a removed checkpoint needed leave with it; then, for a
short window pool, checkpoints on paths requests lock whose window pages nobody reads any more.
A base of `PrefixCache` (prefix_cache.py), which holds the tree these methods walk."""
from __future__ import annotations

import heapq
from typing import Mapping

from hyrax.actors.engine.prefix_nodes import Checkpoint, InUse, Node, Units, checkpoint_pool
from hyrax.actors.model.components import ComponentSpec


class Eviction:
    def evict(self, need: Mapping[str, int] | None = None, in_use: InUse | None = None) -> Units:
        """Free least recently used unreferenced leaves (every component of a node together)
        until `need` (pool -> units) is met, or everything evictable is gone when `need` is
        None. Given `in_use` (what requests read), a window pool still short then takes
        checkpoints on locked paths too (`_evict_locked_checkpoints`). Returns the freed units:
        the caller gives them back to its allocators."""
        unknown = set(need or ()) - set(self.pools)
        if unknown:
            raise ValueError(f"the prefix cache holds no units of {sorted(unknown)}; its pools: {list(self.pools)}")
        freed: Units = {p: [] for p in self.pools}
        heap = [(n.last_access, n.id, n) for n in self.nodes() if not n.children and n.ref == 0]
        heapq.heapify(heap)

        def met() -> bool:
            return need is not None and all(len(freed.get(p, ())) >= k for p, k in need.items())

        while heap and not met():
            _, _, n = heapq.heappop(heap)
            if n.children or n.ref or n.parent is None or n.parent.children.get(n.key[:self.page_size]) is not n:
                continue
            parent = self._remove(n, freed)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if need is not None and in_use is not None and not met():
            self._evict_locked_checkpoints(need, in_use, freed)
        return {p: u for p, u in freed.items() if u}

    def _evict_locked_checkpoints(self, need: Mapping[str, int], in_use: InUse, freed: Units) -> None:
        """A running request locks the node of its last insert, and with it every checkpoint
        above on its path, whose window pages it stops reading once its window has passed them:
        with the lock alone they would stay until it leaves, and a small window pool runs dry.
        So while a window pool of `need` is short (every unreferenced node is gone by now),
        checkpoints no hit has still to copy (`in_use.hits`) are taken off in turn, and each
        window page no remaining checkpoint needs and no request reads (`in_use.window`) goes.
        Each checkpoint's window overlaps the next one's on its path, so a page may go only once
        a run of them is off: at the end, one that lost none of its pages is put back, the
        others go with their slots. Their nodes stay (requests read their token pages); without
        a checkpoint a node is never a hit, and a leaf left so goes when its last lock does
        (`PrefixCache.unlock`). Checkpoints written after the prompt go first (a later request
        shares a prompt more often than an output), then the least recently used, then among
        equals (an insert touches its whole path) the one fewer requests lock, then the
        shallower."""
        short = [p for p in (c.name for c in self.windows) if len(freed[p]) < need.get(p, 0)]
        if not short:
            return
        nodes = sorted((n for n in self.nodes() if n.checkpoint is not None and n not in in_use.hits),
                       key=lambda n: (n.checkpoint.in_prompt, n.last_access, n.ref, n.end, n.id))
        off: list[tuple[Node, Checkpoint]] = []
        for n in nodes:
            pages = self._window_only_of(n, in_use)
            if pages is None:
                continue  # a request reads a page only it needs
            off.append((n, n.checkpoint))
            n.checkpoint = None
            for name, owner, j in pages:
                freed[name].append(owner.window[name][j])
                owner.window[name][j] = -1
            short = [p for p in short if len(freed[p]) < need[p]]
            if not short:
                break
        for n, ck in off:
            if self._window_held(n):
                n.checkpoint = ck  # none of its pages went: it stays a hit
                continue
            for name, slot in ck.slots.items():
                freed[checkpoint_pool(name)].append(slot)
            if not n.children and n.ref == 0:
                self._remove(n, freed)

    def _window_held(self, node: Node) -> bool:
        """Whether the tree holds every window page a hit at `node` would copy."""
        path = self._path(node)
        return all(self._window_page(path, c.name, k) >= 0 for c in self.windows
                   for k in self._window_needs(c, node.end))

    def _window_only_of(self, node: Node, in_use: InUse) -> list[tuple[str, Node, int]] | None:
        """The window pages (component, node holding it, index on its edge) that only the
        checkpoint at `node` needs; None if a request reads one of them."""
        path, out = self._path(node), []
        for c in self.windows:
            reading = in_use.window.get(c.name, ())
            for k in self._window_needs(c, node.end):
                owner, j = self._locate(path, k)
                unit = owner.window[c.name][j]
                if unit < 0 or self._window_needed(owner, c, k, but=node):
                    continue
                if unit in reading:
                    return None
                out.append((c.name, owner, j))
        return out

    def drop(self, node: Node) -> Units | None:
        """Remove leaf `node` (a corrupt checkpoint) with every component it holds; None (and
        nothing removed) while it has children or references."""
        if node.children or node.ref or node.parent is None:
            return None
        freed: Units = {p: [] for p in self.pools}
        self._remove(node, freed)
        return {p: u for p, u in freed.items() if u}

    def flush(self) -> Units:
        """Evict everything no request references."""
        return self.evict(None)

    def _remove(self, n: Node, freed: Units) -> Node:
        """Detach leaf `n`, freeing its units, the window pages above it only its checkpoint
        needed, and ancestors left as leaves without a checkpoint. Returns the first parent kept."""
        while True:
            parent = n.parent
            for pool, units in self._units(n):
                freed[pool].extend(units)
            del parent.children[n.key[:self.page_size]]
            n.parent = None
            if n.checkpoint is not None:
                self._drop_unneeded_window(parent, n.end, freed)
            if parent is self.root or parent.children or parent.ref or parent.checkpoint is not None:
                return parent
            n = parent

    def _drop_unneeded_window(self, node: Node, end: int, freed: Units) -> None:
        """After a checkpoint at `end` below `node` left: free the window pages on the path that
        no remaining checkpoint needs."""
        path = self._path(node)
        for c in self.windows:
            for k in self._window_needs(c, end):
                if not path or k * self.page_size >= path[-1].end:
                    continue  # on the removed node itself: already freed
                owner, j = self._locate(path, k)
                if owner.window[c.name][j] < 0:
                    continue
                if not self._window_needed(owner, c, k):
                    freed[c.name].append(owner.window[c.name][j])
                    owner.window[c.name][j] = -1

    def _window_needed(self, node: Node, comp: ComponentSpec, page: int, but: Node | None = None) -> bool:
        """Whether a checkpoint at or below `node` (other than the one at `but`) needs window
        page `page` of `comp`."""
        horizon = (page + 1) * self.page_size + comp.window
        stack = [node]
        while stack:
            n = stack.pop()
            if n.checkpoint is not None and n is not but and page in self._window_needs(comp, n.end):
                return True
            stack.extend(ch for ch in n.children.values() if ch.start < horizon)
        return False
