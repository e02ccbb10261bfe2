"""The prefix cache's invariants: tree structure, reference counts, the window rows each
checkpoint needs, and (given the allocators) that the tree owns exactly what it holds."""
from __future__ import annotations

from typing import TYPE_CHECKING, Mapping

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.prefix_nodes import Node, PrefixCacheError

if TYPE_CHECKING:
    from hyrax.actors.engine.prefix_cache import PrefixCache


def check_tree(self: PrefixCache, allocators: Mapping[str, IndexAllocator] | None = None,
               leaving: Mapping[str, list[int]] | None = None) -> None:
    """Structure, reference counts and window rows; with `allocators` (pool name -> its
    allocator) also that the tree owns exactly the units it holds - and `leaving`, units it let
    go that are freed once the step in flight is committed - and every pool balances."""
    ps = self.page_size

    def fail(msg):
        raise PrefixCacheError(msg)

    def check(n: Node) -> int:
        """Checks the subtree of `n`; returns the locks in it."""
        locks = n.locks
        for key, ch in n.children.items():
            if ch.parent is not n or ch.key[:ps] != key:
                fail(f"{ch!r}: parent/child links disagree")
            if not ch.key or len(ch.key) % ps or ch.start != n.end:
                fail(f"{ch!r}: an edge must be a whole number of pages starting at its parent's end")
            pages = len(ch.key) // ps
            if {c.name for c in self.tokens} != set(ch.full) or any(len(u) != pages for u in ch.full.values()):
                fail(f"{ch!r}: full pages do not cover the edge")
            if {c.name for c in self.windows} != set(ch.window) or any(len(u) != pages
                                                                       for u in ch.window.values()):
                fail(f"{ch!r}: window table does not cover the edge")
            if not ch.children and ch.checkpoint is None and not ch.locks:
                # (a locked one lost its checkpoint to eviction: it goes with its last lock)
                fail(f"{ch!r}: a leaf without a checkpoint nobody locks can never be hit")
            locks += check(ch)
        if n.ref != locks or n.locks < 0:
            fail(f"{n!r}: ref {n.ref} != locks at and below it {locks}")
        return locks

    check(self.root)
    for n in self.nodes():  # window rows: every checkpoint has what a hit needs, nothing else is held
        path = self._path(n)
        for c in self.windows:
            if n.checkpoint is not None:
                for k in self._window_needs(c, n.end):
                    if self._window_page(path, c.name, k) < 0:
                        fail(f"{n!r}: {c.name} page {k} needed by the checkpoint is not held")
            for j, unit in enumerate(n.window[c.name]):
                if unit >= 0 and not self._window_needed(n, c, n.start // ps + j):
                    fail(f"{n!r}: {c.name} page {n.start // ps + j} is held but no checkpoint needs it")
    held = self.held()
    for pool, units in held.items():
        if len(set(units)) != len(units):
            fail(f"{pool}: a unit is held twice by the tree")
    if allocators is None:
        return
    leaving = leaving or {}
    for pool, units in held.items():
        alloc = allocators[pool]
        alloc.check()
        going = set(leaving.get(pool, ()))
        if going & set(units):
            fail(f"{pool}: units {sorted(going & set(units))} are held by the tree and waiting to be freed")
        if set(alloc.owned_by(self.owner)) != set(units) | going:
            fail(f"{pool}: the tree holds {sorted(units)} (and lets go of {sorted(going)} after the step in "
                 f"flight), the allocator says it owns {alloc.owned_by(self.owner)}")
