"""StepPlan: the one immutable message a coordinator sends to every rank per step.

Result processing reads the plan of the step it belongs to — never live request fields
that a later step may already have advanced (the overlap-scheduling lesson).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SamplingSpec:
    temperature: float
    top_p: float
    top_k: int
    seed: int
    draw: int  # index of the token being drawn (number of outputs so far)
    logprobs: int | None = None  # also report logprobs: the chosen token's and this many top ones


@dataclass(frozen=True)
class PlanEntry:
    req_id: str
    token_ids: tuple[int, ...]
    start: int  # position of token_ids[0]
    page_tables: dict[str, tuple[int, ...]]
    slots: dict[str, int]
    sample: SamplingSpec | None  # None: a prefill chunk that does not reach the end

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class StepPlan:
    step: int
    entries: tuple[PlanEntry, ...]
    zero_slots: dict[str, tuple[int, ...]]  # freshly allocated slots, zeroed before the forward
    deterministic: bool = False
    forget: tuple[str, ...] = ()  # requests that left the replica: ranks drop their last token

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries)
