"""Which requests a command applies to.

`Selection`: an operator's choice — ids, a count (by the victim policy for retraction, oldest
first for resume), or all of them; one value, handed through every layer.
`pick_victims`: the one victim policy, for forced, memory-pressure and operator retraction.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence, TypeVar


@dataclass(frozen=True)
class Selection:
    ids: tuple[str, ...] = ()
    count: int | None = None
    all: bool = False

    def __post_init__(self):
        if sum([bool(self.ids), self.count is not None, bool(self.all)]) != 1:
            raise ValueError("select by exactly one of ids, count, all")


class Candidate(Protocol):
    """What the victim policy reads: a `Request`, or the scheduler's view of one."""

    id: str
    arrival: float

    @property
    def num_prompt(self) -> int: ...

    @property
    def num_outputs(self) -> int: ...


C = TypeVar("C", bound=Candidate)


def victim_order(r: Candidate) -> tuple:
    """Fewest generated tokens first, then longest prompt, then oldest."""
    return (r.num_outputs, -r.num_prompt, r.arrival)


def pick_victims(running: Sequence[C], n: int, exclude: set[str] | frozenset[str] = frozenset(),
                 keep_last: bool = True) -> list[C]:
    """Up to `n` victims in `victim_order`. Forced and memory-pressure retraction never take
    the last running request (`keep_last`); an operator's explicit retraction may."""
    cands = sorted((r for r in running if r.id not in exclude), key=victim_order)
    n = min(n, len(running) - 1 if keep_last else len(running), len(cands))
    return cands[: max(n, 0)]
