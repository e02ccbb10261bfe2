"""Which requests an operator's command applies to: ids, a count (by the victim policy for
retraction, oldest first for resume), or all of them. One value, handed through every layer."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Selection:
    ids: tuple[str, ...] = ()
    count: int | None = None
    all: bool = False

    def __post_init__(self):
        if sum([bool(self.ids), self.count is not None, self.all]) != 1:
            raise ValueError("select by exactly one of ids, count, all")
