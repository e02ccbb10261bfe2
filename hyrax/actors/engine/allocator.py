"""Index allocators: pages for paged components, slots for slot components.

The coordinator owns them (single source of truth); ranks only ever see the indices in a
plan. Each index has at most one owner; `check()` verifies free + used == capacity and
no double ownership, cheaply enough to run at idle and after every test.
"""
from __future__ import annotations


class AllocationError(RuntimeError):
    pass


class IndexAllocator:
    """Hands out integer indices 0..capacity-1 to owners (request ids)."""

    def __init__(self, name: str, capacity: int):
        if capacity < 1:
            raise ValueError(f"{name}: capacity must be positive, got {capacity}")
        self.name = name
        self.capacity = capacity
        # LIFO free list: a just-freed index is handed out next, which makes reuse (and any
        # bug that depends on it) happen as early as possible.
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._owner: dict[int, str] = {}

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._owner)

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, owner: str, n: int, avoid: set[int] | frozenset[int] = frozenset()) -> list[int]:
        """`n` free indices for `owner`, most recently freed first, skipping the indices in
        `avoid` while others are free (used by restores: see StateMoves.load in moves.py)."""
        if n > len(self._free):
            raise AllocationError(f"{self.name}: need {n}, {len(self._free)} free")
        if not avoid:
            out = self._free[len(self._free) - n:][::-1]
            del self._free[len(self._free) - n:]
        else:
            # newest first, the avoided ones only when nothing else is left. At most len(avoid)
            # of the last n + len(avoid) free indices are avoided, so when the list is longer
            # than that, those last ones hold the n to hand out: only they are scanned.
            free = self._free
            cut = max(0, len(free) - n - len(avoid))
            tail = free[cut:]
            out = [i for i in reversed(tail) if i not in avoid][:n]
            if len(out) < n:  # the whole list was scanned (cut == 0): take avoided ones, newest first
                out += [i for i in reversed(tail) if i in avoid][:n - len(out)]
            taken = set(out)
            del free[cut:]  # in place: the untouched head is not copied
            free.extend([i for i in tail if i not in taken])
        self._owner.update(dict.fromkeys(out, owner))
        return out

    def peek(self, n: int) -> list[int]:
        """The next `n` indices `allocate` would hand out, in that order (fewer if fewer are free)."""
        return self._free[-n:][::-1] if n > 0 else []

    def claim(self, owner: str, indices: tuple[int, ...] | list[int]) -> None:
        """Give `owner` exactly these free indices (a scheduler took them from `peek`)."""
        k = len(indices)
        if k == 0:
            return
        if self._free[-k:][::-1] == list(indices):  # the usual case: the next ones, in order
            del self._free[len(self._free) - k:]
        else:
            taken = set(indices)
            if len(taken) != k or not taken <= set(self._free):
                raise AllocationError(f"{self.name}: cannot claim {list(indices)}: not all free")
            self._free = [i for i in self._free if i not in taken]
        for i in indices:
            self._owner[i] = owner

    def free(self, owner: str, indices: list[int]) -> None:
        get = self._owner.get
        if not all(get(i) == owner for i in indices):
            i = next(i for i in indices if get(i) != owner)
            raise AllocationError(f"{self.name}: index {i} is owned by {get(i)!r}, not {owner!r}")
        pop = self._owner.pop
        for i in indices:
            pop(i)
        self._free.extend(indices)

    def give(self, old: str, new: str, indices: list[int]) -> None:
        """Indices owned by `old` are owned by `new` from now on (never free in between)."""
        for i in indices:
            if self._owner.get(i) != old:
                raise AllocationError(f"{self.name}: index {i} is owned by {self._owner.get(i)!r}, not {old!r}")
        for i in indices:
            self._owner[i] = new

    def owns(self, owner: str, indices) -> bool:
        """Whether `owner` holds every one of `indices` (without scanning the pool)."""
        get = self._owner.get
        return all(get(i) == owner for i in indices)

    def owned_by(self, owner: str) -> list[int]:
        return sorted(i for i, o in self._owner.items() if o == owner)

    def owners(self) -> set[str]:
        return set(self._owner.values())

    def check(self) -> None:
        """free + used == capacity, every index in exactly one place."""
        free = set(self._free)
        if len(free) != len(self._free):
            raise AllocationError(f"{self.name}: an index is free twice")
        if free & self._owner.keys():
            raise AllocationError(f"{self.name}: an index is both free and owned")
        if len(free) + len(self._owner) != self.capacity:
            raise AllocationError(
                f"{self.name}: free {len(free)} + used {len(self._owner)} != capacity {self.capacity}"
            )
