"""A request's unit indices (page table, or (slot,), per component) and the snapshots of them
that scheduler views and plans share.

`IndexTable` is `Request.indices`: a dict whose values are tuples, replaced and never edited.
`snapshot()` gives an `IndexSnapshot` of it, the same object until the table next changes, so
a request decoding inside pages it holds is seen through one snapshot step after step instead
of a new copy per step; `IndexSnapshot.split` keeps the scheduler's per-entry dicts with it.
"""
from __future__ import annotations

from typing import Iterable, Mapping


class IndexSnapshot(dict):
    """What a request held when a view was made. Never mutated once made (views and plans share
    it); `split` remembers its answer for the component names it was last asked about."""

    __slots__ = ("_split",)

    def split(self, paged: tuple[str, ...], slotted: tuple[str, ...]):
        """({paged name: page table}, {slot name: slot}) - the shape of a plan entry's tables and
        slots - or None when a paged component has no table here. The same two dicts every time
        (for the same names), so callers must not mutate them."""
        memo = getattr(self, "_split", None)
        if memo is not None and memo[0] is paged and memo[1] is slotted:
            return memo[2]
        out = None
        if all(name in self for name in paged):
            out = ({name: self[name] for name in paged}, {name: self[name][0] for name in slotted})
        self._split = (paged, slotted, out)
        return out


class IndexTable(dict):
    """`Request.indices`. Every write drops the cached snapshot; values are tuples."""

    __slots__ = ("_snap",)

    def __init__(self, items: Mapping[str, Iterable[int]] | Iterable = (), **kw):
        super().__init__(items, **kw)
        self._snap = None

    def snapshot(self) -> IndexSnapshot:
        snap = getattr(self, "_snap", None)  # unset in a copy made without __init__ (pickle, copy)
        if snap is None:
            snap = self._snap = IndexSnapshot(self)
        return snap

    def __setitem__(self, key, value) -> None:
        self._snap = None
        super().__setitem__(key, value)

    def __delitem__(self, key) -> None:
        self._snap = None
        super().__delitem__(key)

    def update(self, *args, **kw) -> None:
        self._snap = None
        super().update(*args, **kw)

    def pop(self, *args):
        self._snap = None
        return super().pop(*args)

    def popitem(self):
        self._snap = None
        return super().popitem()

    def setdefault(self, key, default=None):
        self._snap = None
        return super().setdefault(key, default)

    def clear(self) -> None:
        self._snap = None
        super().clear()

    def __ior__(self, other):
        self._snap = None
        return super().__ior__(other)
