"""The prefix cache's values: its tree nodes, a checkpoint, what a match and an insert report,
and moving units between an owner and the tree (prefix_cache.py holds the tree itself)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

from hyrax.actors.engine.allocator import IndexAllocator

CACHE_OWNER = "prefix-cache"
Units = dict[str, list[int]]  # pool name -> units


class PrefixCacheError(RuntimeError):
    """The tree, or the tree and its allocators, disagree with themselves."""


def checkpoint_pool(name: str) -> str:
    """The pool holding checkpoints of slot component `name` (its own allocator, its own rows)."""
    return f"{name}.checkpoint"


@dataclass(frozen=True)
class Checkpoint:
    """Recurrent state after a prefix: a slot per slot component in its checkpoint pool, and
    the state hash of each slot's bytes per TP rank (verified by the engine before a hit uses it)."""

    slots: Mapping[str, int]  # slot component -> slot in checkpoint_pool(component)
    checksums: Mapping[str, Mapping[int, int]] = field(default_factory=dict)  # component -> rank -> state hash
    # taken while prefilling a prompt (at or before its last whole page): the state then depends only
    # on the tokens and the position-only chunk schedule, so deterministic mode may reuse it exactly
    in_prompt: bool = True


class Node:
    __slots__ = ("id", "parent", "key", "start", "children", "full", "window", "checkpoint", "locks", "ref",
                 "last_access")

    def __init__(self, nid: int, parent: Node | None, key: tuple[int, ...], start: int):
        self.id = nid
        self.parent = parent
        self.key = key  # token ids of the edge into this node (a whole number of pages)
        self.start = start  # position of key[0]
        self.children: dict[tuple[int, ...], Node] = {}  # by the child's first page of tokens
        self.full: dict[str, list[int]] = {}  # token component -> one page per edge page
        self.window: dict[str, list[int]] = {}  # window component -> page per edge page, -1 if not held
        self.checkpoint: Checkpoint | None = None
        self.locks = 0  # requests that hold exactly this node
        self.ref = 0  # locks on this node and below: > 0 means nothing here may be freed
        self.last_access = 0

    @property
    def end(self) -> int:
        return self.start + len(self.key)

    def __repr__(self) -> str:
        return f"Node({self.start}..{self.end}, ckpt={self.checkpoint is not None}, ref={self.ref})"


@dataclass(frozen=True)
class Match:
    """The longest cached prefix of a query that ends on a checkpoint (length 0: no hit).

    full: token component -> pages of positions 0..length-1 (share them: lock `node`);
    window: window component -> {page number: cached page} the hit copies into its own pages;
    checkpoint: the recurrent state the hit copies into its own slots."""

    length: int
    node: Node | None
    full: Mapping[str, tuple[int, ...]]
    window: Mapping[str, Mapping[int, int]]
    checkpoint: Checkpoint | None


@dataclass(frozen=True)
class InUse:
    """What requests read of the tree besides the token pages on the paths they lock: the nodes
    whose checkpoint (with its window pages) a hit has still to copy, or is copying in a step not
    committed yet, and, per window component, the cached pages that hold rows of some request's
    live window (pages the tree took from that request's tables at an insert). Eviction of a
    checkpoint on a locked path (`Eviction.evict`) leaves these alone."""

    hits: frozenset = frozenset()  # of Node
    window: Mapping[str, frozenset[int]] = field(default_factory=dict)


@dataclass(frozen=True)
class Inserted:
    """node: the node ending at the inserted length (lock it to keep using the shared pages);
    adopted: units the tree took over from the request (move their ownership to the cache);
    rejected: checkpoint positions not taken (already cached, or window rows missing) — their
    slots stay with the caller;
    reuse: token component -> {page number: the tree's unit} for the pages above `length` the
    tree holds in units other than the request's (a prefix it computed again): once it locks
    `node`, the request reads these and frees its own copies (its lock covers what it reads)."""

    node: Node
    length: int
    adopted: Units
    rejected: tuple[int, ...]
    reuse: Mapping[str, Mapping[int, int]] = field(default_factory=dict)


def transfer(allocators: Mapping[str, IndexAllocator], units: Mapping[str, Sequence[int]], old: str, new: str) -> None:
    """Move the ownership of `units` (pool -> units) from `old` to `new`."""
    for pool, idx in units.items():
        if idx:
            allocators[pool].give(old, new, list(idx))


def give_back(allocators: Mapping[str, IndexAllocator], units: Mapping[str, Sequence[int]],
              owner: str = CACHE_OWNER) -> None:
    """Return units the tree let go (`evict`, `flush`) to their allocators."""
    for pool, idx in units.items():
        if idx:
            allocators[pool].free(owner, list(idx))
