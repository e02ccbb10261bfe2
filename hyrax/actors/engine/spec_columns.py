"""SpecColumns: the sampling parameters of a step's sampling rows as columns, one array per
field, for the sampler to read whole.

A decode block (plan.py) already keeps its rows' temperature, top-p, top-k, draw and seed as
columns; reading them as arrays costs the same at 64 rows as at one, where a `SamplingSpec` per
row and a Python pass per field cost ~1 us per row per step (measured at 64 rows, temperature
1: the sampler's per-row lists and uniform numbers were 60 % of its time). Rows whose spec
carries logit processing or a grammar (only a plan's entries can) keep their whole spec in
`extra`, by row.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np

from hyrax.actors.engine.grammar import GrammarStep
from hyrax.actors.engine.plan import DecodeBlock, SamplingSpec

MASK64 = (1 << 64) - 1


def seed_column(seeds: Sequence[int]) -> np.ndarray:
    """Seeds (any Python ints) as uint64, each taken modulo 2**64 as `sampler.uniform` takes it."""
    try:  # the usual case, every seed in [0, 2**64): one C call (3x cheaper than masking each)
        return np.array(seeds, dtype=np.uint64)
    except OverflowError:  # a negative or larger seed a client chose
        return np.fromiter((s & MASK64 for s in seeds), dtype=np.uint64, count=len(seeds))


@dataclass(frozen=True)
class SpecColumns:
    """R sampling rows. Arrays are never written once made (a block's are views of its own)."""

    temperature: np.ndarray  # float64 (R,)
    top_p: np.ndarray  # float64 (R,)
    top_k: np.ndarray  # int64 (R,), 0: off
    seeds: np.ndarray  # uint64 (R,)
    draws: np.ndarray  # int64 (R,): index of the token each row draws
    logprobs: tuple[int | None, ...]  # per row: also report logprobs (None: no)
    extra: Mapping[int, SamplingSpec] = field(default_factory=dict)  # row -> spec with processing or a grammar

    def __len__(self) -> int:
        return len(self.logprobs)

    @classmethod
    def of(cls, specs: Sequence[SamplingSpec]) -> SpecColumns:
        n = len(specs)
        return cls(np.fromiter((s.temperature for s in specs), dtype=np.float64, count=n),
                   np.fromiter((s.top_p for s in specs), dtype=np.float64, count=n),
                   np.fromiter((s.top_k for s in specs), dtype=np.int64, count=n),
                   seed_column([s.seed for s in specs]),
                   np.fromiter((s.draw for s in specs), dtype=np.int64, count=n),
                   tuple(s.logprobs for s in specs),
                   {k: s for k, s in enumerate(specs) if s.process is not None or s.grammar is not None})

    @classmethod
    def of_block(cls, block: DecodeBlock) -> SpecColumns:
        """A decode block's rows (plain parameters: no processing, no grammar)."""
        return cls(block.temperature, block.top_p, block.top_k, seed_column(block.seeds), block.draws, block.logprobs)

    def then(self, other: SpecColumns) -> SpecColumns:
        """This one's rows, then `other`'s."""
        if not len(other):
            return self
        if not len(self):
            return other
        n = len(self)
        return SpecColumns(*(np.concatenate([a, b]) for a, b in (
            (self.temperature, other.temperature), (self.top_p, other.top_p), (self.top_k, other.top_k),
            (self.seeds, other.seeds), (self.draws, other.draws))),
            self.logprobs + other.logprobs, {**self.extra, **{n + k: s for k, s in other.extra.items()}})

    @property
    def asks_logprobs(self) -> bool:
        return self.logprobs.count(None) != len(self.logprobs)

    @property
    def processed_rows(self) -> list[int]:
        """Rows with logit processing, in order."""
        return sorted(k for k, s in self.extra.items() if s.process is not None)

    def grammars(self) -> list[GrammarStep | None] | None:
        """Each row's grammar step (None for a row without one); None when no row has one."""
        at = {k: s.grammar for k, s in self.extra.items() if s.grammar is not None}
        if not at:
            return None
        return [at.get(k) for k in range(len(self))]
