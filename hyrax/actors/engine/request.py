"""Requests and their sampling parameters, as the coordinator tracks them."""
from __future__ import annotations

import enum
import math
import time
from dataclasses import dataclass, field
from functools import cached_property

from hyrax.actors.engine.grammar import GrammarSpec
from hyrax.actors.engine.indices import IndexTable
from hyrax.actors.model.errors import HyraxInputError

# A client's seed (API `seed`, `hyrax generate --seed`): a signed 64-bit integer, as vLLM takes
# it. The sampler reduces seeds modulo 2**64, so a wider range would give one stream two names.
SEED_MIN, SEED_MAX = -2**63, 2**63 - 1


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
    # token-level logit processing (sampler.apply_penalties), on the request's own tokens only
    presence_penalty: float = 0.0  # subtracted once from each token already generated
    frequency_penalty: float = 0.0  # subtracted per occurrence in the generated tokens
    repetition_penalty: float = 1.0  # tokens of prompt or output: positive logits / p, negative * p
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many tokens are generated
    min_p: float = 0.0  # after temperature: tokens less likely than min_p x the most likely one are dropped
    grammar: GrammarSpec | None = None  # structured output: the answer matches it, then EOS ends it

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises HyraxInputError; token ids (logit_bias, stop_token_ids) are checked against
        `vocab_size` when given."""
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
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not (math.isfinite(v) and -2 <= v <= 2):
                raise HyraxInputError(f"{name} must be in [-2, 2], got {v!r}")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0):
            raise HyraxInputError(f"repetition_penalty must be > 0, got {self.repetition_penalty!r}")
        if any(not math.isfinite(b) for _, b in self.logit_bias):
            raise HyraxInputError("logit_bias values must be finite")
        ids = [t for t, _ in self.logit_bias] + list(self.stop_token_ids)
        if any(not isinstance(t, int) or t < 0 or (vocab_size is not None and t >= vocab_size) for t in ids):
            raise HyraxInputError(f"logit_bias and stop_token_ids must be token ids in [0, {vocab_size or 'vocab'})")
        if not (math.isfinite(self.min_p) and 0 <= self.min_p <= 1):
            raise HyraxInputError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise HyraxInputError(f"min_tokens must be in [0, max_tokens], got {self.min_tokens!r}")
        if self.grammar is not None:
            if self.ignore_eos or self.min_tokens:
                raise HyraxInputError("structured output ends the answer with EOS when the grammar is complete: "
                                      "it cannot be combined with ignore_eos or min_tokens")
            self.grammar.check()

    @cached_property  # read per request per step (SamplingSpec.of); the fields never change
    def processes_logits(self) -> bool:
        """Whether the sampler must look at the request's tokens (or bias logits) before sampling."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens or self.min_p)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class State(str, enum.Enum):
    """Assigned only by `lifecycle.RequestTable`."""

    WAITING = "waiting"
    RUNNING = "running"
    RETRACTED = "retracted"
    OFFERED = "offered"  # exported to another replica; state held until it acknowledges or the lease ends
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
    # page table, or (slot,), per component: tuples, replaced (never edited) when they change, so the
    # scheduler's view and the plans share them without a copy; views see it through its snapshot
    # (indices.py), the same object while nothing changes
    indices: IndexTable = field(default_factory=IndexTable)
    hold: bool = False  # retracted and held until resumed explicitly
    backup: object | None = None  # a Backup while retracted with state kept
    retractions: int = 0
    hops: int = 0  # imports it came by (prefill -> decode, migrations): its newest holder has the most
    transferred_bytes: dict[str, int] = field(default_factory=dict)  # imported state, per component
    export_payload: list | None = None  # while offered: the exported shards (kept alive until acked)
    offer_deadline: float | None = None  # while offered: monotonic time the lease ends
    # while offered: the gateway whose stream carried its hand-off (None: not known, or an in-process caller)
    offer_carrier: str | None = None
    retracted_at_step: int = -1  # not resumed automatically in the step that retracted it
    finish_reason: str | None = None
    text: str = ""
    stop_scan: object | None = field(default=None, repr=False, compare=False)  # TextStream over output_ids
    cache: object | None = field(default=None, repr=False, compare=False)  # caching.CacheHold: what it holds of the prefix cache
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
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_outputs(self) -> int:
        return len(self.output_ids)

    @property
    def pending(self) -> int:
        """Tokens known but not yet run through the model."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        return self.pending > 1
