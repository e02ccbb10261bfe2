"""Requests and their sampling parameters, as the coordinator tracks them."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field

from hyrax.actors.model.errors import HyraxInputError


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # return the chosen token's logprob and this many alternatives

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise HyraxInputError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise HyraxInputError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise HyraxInputError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.top_k < 0:
            raise HyraxInputError(f"top_k must be >= 0 (0 = off), got {self.top_k!r}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise HyraxInputError(f"logprobs must be in [0, 20], got {self.logprobs!r}")
        if any(not s for s in self.stop):
            raise HyraxInputError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class State(str, enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    RETRACTED = "retracted"
    HANDOFF = "handoff"  # exported to another replica; indices held until it acknowledges
    FINISHED = "finished"


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # the sampling stream: params.seed, or one drawn at arrival
    output_ids: list[int] = field(default_factory=list)
    state: State = State.WAITING
    num_computed: int = 0  # tokens whose state is in the device pools (the snapshot point)
    indices: dict[str, list[int]] = field(default_factory=dict)  # page table, or [slot]
    hold: bool = False  # retracted and held until resumed explicitly
    backup: object | None = None  # a Backup while retracted with state kept
    retractions: int = 0
    transferred_bytes: dict[str, int] = field(default_factory=dict)  # imported state, per component
    export_payload: list | None = None  # while handed off: the exported shards (kept alive until acked)
    finish_reason: str | None = None
    text: str = ""
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    first_scheduled_at: float | None = None
    finished_at: float | None = None

    @property
    def all_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens known but not yet run through the model."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.pending > 1
