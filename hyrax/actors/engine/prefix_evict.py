"""Eviction from the prefix cache: least recently used unreferenced nodes leave with every
component together, and window pages only a removed checkpoint needed leave with it. A base
of `PrefixCache` (prefix_cache.py), which holds the tree these methods walk."""
from __future__ import annotations

import heapq
from typing import Mapping

from hyrax.actors.engine.prefix_nodes import Node, Units
from hyrax.actors.model.components import ComponentSpec


class Eviction:
    def evict(self, need: Mapping[str, int] | None = None) -> Units:
        """Free least recently used unreferenced leaves (every component of a node together)
        until `need` (pool -> units) is met, or everything evictable is gone when `need` is
        None. Returns the freed units: the caller gives them back to its allocators."""
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
        return {p: u for p, u in freed.items() if u}

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

    def _window_needed(self, node: Node, comp: ComponentSpec, page: int) -> bool:
        """Whether a checkpoint at or below `node` needs window page `page` of `comp`."""
        horizon = (page + 1) * self.page_size + comp.window
        stack = [node]
        while stack:
            n = stack.pop()
            if n.checkpoint is not None and page in self._window_needs(comp, n.end):
                return True
            stack.extend(ch for ch in n.children.values() if ch.start < horizon)
        return False
