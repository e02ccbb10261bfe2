"""StepPlan: the one immutable message a coordinator sends to every rank per step, and
StepResult: the one answer a step gives back (rank 0's tokens, every rank's checkpoint checksums).

Result processing reads the plan of the step it belongs to — never live request fields
that a later step may already have advanced (the overlap-scheduling lesson).
"""
from __future__ import annotations

import math
from array import array
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import numpy as np

from hyrax.actors.engine.grammar import GrammarSpec, GrammarStep

PLACEHOLDER = -1  # "the token this request samples in the step still in flight" (ranks fill it in)
TOP_K_OFF_FROM = 2**31  # a top_k this large exceeds every vocabulary: no top-k


@dataclass(frozen=True)
class LogitProcessing:
    """Penalties, bias, min_tokens and min_p of one request, with the tokens they depend on. Built
    from the coordinator's request (never from rank-side memory), so a retracted, restored,
    transferred or migrated request is processed exactly as if it had never moved."""

    presence: float
    frequency: float
    repetition: float
    bias: tuple[tuple[int, float], ...]
    suppress: tuple[int, ...]  # masked while draw < min_tokens (the rank adds EOS unless ignore_eos)
    min_tokens: int
    ignore_eos: bool
    history: array  # int32 prompt + output ids up to this step; a negative last id is the in-flight token
    min_p: float = 0.0  # after temperature, tokens less likely than min_p x the most likely are dropped


class SamplingSpec(NamedTuple):
    """How one entry draws its token. Immutable; a NamedTuple rather than a frozen dataclass
    (as `PlanEntry`): one is built per request per step, and a frozen dataclass's per-field
    `object.__setattr__` made that ~4x dearer (2.3 vs 0.5 us)."""

    temperature: float
    top_p: float
    top_k: int
    seed: int
    draw: int  # index of the token being drawn (number of outputs so far)
    logprobs: int | None = None  # also report logprobs: the chosen token's and this many top ones
    process: LogitProcessing | None = None  # None: sample from the model's logits as they are
    grammar: GrammarStep | None = None  # structured output: rank 0 masks what the grammar does not allow

    @classmethod
    def of(cls, p, seed: int, draw: int, ids: Sequence[int]) -> SamplingSpec:
        """The spec for drawing output `draw` with SamplingParams `p`; `ids` are the request's
        tokens up to this step (prompt + outputs, the in-flight one as a placeholder). They
        travel in the plan only when `p` processes logits, as a compact int32 array (about 10x
        cheaper to pickle than a tuple, and read without a copy on the rank)."""
        # a top_k past any vocabulary means no top-k (as one of the vocabulary's size does): 0,
        # so that it fits the int64 columns plans and the sampler keep (the API bounds it only below)
        top_k = p.top_k if p.top_k < TOP_K_OFF_FROM else 0
        if p.grammar is None and not p.processes_logits:  # the common case: the model's logits as they are
            return cls(p.temperature, p.top_p, top_k, seed, draw, p.logprobs)
        process = None
        if p.processes_logits:
            process = LogitProcessing(p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.logit_bias,
                                      tuple(p.stop_token_ids), p.min_tokens, p.ignore_eos, array("i", ids), p.min_p)
        return cls(p.temperature, p.top_p, top_k, seed, draw, p.logprobs, process,
                   GrammarStep.of(p.grammar, ids, draw))


class PlanEntry(NamedTuple):
    """One request's part of a step (immutable; a NamedTuple for the cost, see `SamplingSpec`)."""

    req_id: str
    token_ids: tuple[int, ...]
    start: int  # position of token_ids[0]
    page_tables: dict[str, tuple[int, ...]]
    slots: dict[str, int]
    sample: SamplingSpec | None  # None: a prefill chunk that does not reach the end

    @property
    def end(self) -> int:
        return self.start + len(self.token_ids)


# the fixed columns of `DecodeBlock.ints`, before one per slot component and one per paged one
START, DRAW, TOP_K, MAX_TOKENS, STOPS, LEFT = range(6)
_ADVANCE: dict[int, np.ndarray] = {}  # row width -> the row added by one step


def _column(array: str, index: int) -> property:
    """A read-only property: column `index` of the block's `array` ("ints" or "floats")."""
    return property(lambda block: getattr(block, array)[:, index])


@dataclass(frozen=True, eq=False)
class DecodeBlock:
    """Steady decodes of a step as columns, one row each: one token at `starts[k]` inside a page
    the request holds, sampled with plain parameters (no penalties, bias, min_tokens or grammar).
    Made by the decode lane (lane.py) without a per-request object; `entry(k)` is the
    `PlanEntry` the general path makes for the same row. The integer columns share one (B, C)
    array and the float ones one (B, 2), so that taking, joining or advancing rows is a few
    array operations whatever the number of columns. Arrays are never written once made."""

    req_ids: tuple[str, ...]
    # int64 (B, 6 + S + P): start (position of the row's token), draw (index of the token it
    # draws), top_k, max_tokens, stops (1: the request stops on stop ids or strings, so results
    # check every token), left (how many more steps the lane may advance the row: lane.py),
    # then the slot of each of `slot_names`, then the length of each row's page table of each
    # of `tables`
    ints: np.ndarray
    floats: np.ndarray  # float64 (B, 2): temperature, top_p
    tables: dict[str, np.ndarray]  # paged component -> (B, P) int64 page tables, -1 after a row's own
    slot_names: tuple[str, ...]
    seeds: tuple[int, ...]
    logprobs: tuple[int | None, ...]
    tokens: np.ndarray | None = None  # int64 (B,): each row's token; None: every row's is the one in flight

    def __len__(self) -> int:
        return len(self.req_ids)

    def __reduce__(self):
        """Pickled with its arrays as one run of raw bytes: a plan crosses to the ranks every step,
        and numpy's own pickling cost ~10 us an array each way (a 32-row block: ~50 us to
        pickle, ~35 to load)."""
        arrays = (self.ints, self.floats, *self.tables.values(), *(() if self.tokens is None else (self.tokens,)))
        return (_block_of_bytes, (self.req_ids, tuple(self.tables), self.slot_names, self.seeds, self.logprobs,
                                  self.tokens is not None, tuple((a.shape, a.dtype.str) for a in arrays),
                                  b"".join([np.ascontiguousarray(a).tobytes() for a in arrays])))

    # (B,) views of single columns
    starts = _column("ints", START)
    draws = _column("ints", DRAW)
    top_k = _column("ints", TOP_K)
    max_tokens = _column("ints", MAX_TOKENS)
    stops = _column("ints", STOPS)
    temperature = _column("floats", 0)
    top_p = _column("floats", 1)

    @property
    def slots(self) -> dict[str, np.ndarray]:
        return {n: self.ints[:, LEFT + 1 + k] for k, n in enumerate(self.slot_names)}

    @property
    def n_pages(self) -> dict[str, np.ndarray]:
        at = LEFT + 1 + len(self.slot_names)
        return {n: self.ints[:, at + k] for k, n in enumerate(self.tables)}

    def advanced(self, tokens: np.ndarray | None) -> DecodeBlock:
        """The rows one step on (position and draw + 1, one step less left), running `tokens`
        (None: in flight)."""
        width = self.ints.shape[1]
        step = _ADVANCE.get(width)
        if step is None:
            step = _ADVANCE[width] = np.zeros(width, dtype=np.int64)
            step[[START, DRAW, LEFT]] = 1, 1, -1
        return DecodeBlock(self.req_ids, self.ints + step, self.floats, self.tables, self.slot_names, self.seeds,
                           self.logprobs, tokens)

    def rows(self, keep: np.ndarray) -> DecodeBlock:
        """Rows `keep` (int64 indices, in order); tables keep their width (columns past a row's
        own pages are -1)."""
        ks = keep.tolist()
        return DecodeBlock(
            tuple(self.req_ids[k] for k in ks), self.ints[keep], self.floats[keep],
            {n: t[keep] for n, t in self.tables.items()}, self.slot_names,
            tuple(self.seeds[k] for k in ks), tuple(self.logprobs[k] for k in ks),
            None if self.tokens is None else self.tokens[keep])

    def entry(self, k: int) -> PlanEntry:
        start = int(self.starts[k])
        token = (PLACEHOLDER,) if self.tokens is None else (int(self.tokens[k]),)
        return PlanEntry(self.req_ids[k], token, start,
                         {n: tuple(t[k, :int(self.n_pages[n][k])].tolist()) for n, t in self.tables.items()},
                         {n: int(s[k]) for n, s in self.slots.items()},
                         SamplingSpec(float(self.temperature[k]), float(self.top_p[k]), int(self.top_k[k]),
                                      self.seeds[k], int(self.draws[k]), self.logprobs[k]))


def _block_of_bytes(req_ids, table_names, slot_names, seeds, logprobs, has_tokens, layout, data) -> DecodeBlock:
    """`DecodeBlock.__reduce__`'s other half: the arrays read back from one writable copy of the bytes."""
    buf, at, arrays = bytearray(data), 0, []
    for shape, dtype in layout:
        a = np.frombuffer(buf, dtype=dtype, count=math.prod(shape), offset=at).reshape(shape)
        at += a.nbytes
        arrays.append(a)
    ints, floats, *rest = arrays
    tokens = rest.pop() if has_tokens else None
    return DecodeBlock(req_ids, ints, floats, dict(zip(table_names, rest)), slot_names, seeds, logprobs, tokens)


@dataclass(frozen=True)
class UnitCopy:
    """Before the forward: copy units `src` of pool `src_pool` into units `dst` of pool `dst_pool`
    (pages of a paged pool, slots otherwise) - a prefix-cache hit's window pages and checkpoint.
    `expect`: for a checkpoint slot, the state hash each rank recorded when it was cached
    ((rank, hash) pairs; None for window pages, which are not checked): every rank checks its
    slot before the step writes anything, and the step raises `CheckpointMismatch` for `req_id`
    where one differs or where a rank recorded none."""

    src_pool: str
    src: tuple[int, ...]
    dst_pool: str
    dst: tuple[int, ...]
    req_id: str = ""
    expect: tuple[tuple[int, int], ...] | None = None


class CheckpointMismatch(RuntimeError):
    """A prefix-cache hit's checkpoint no longer hashes, on some rank, to what it hashed to when
    it was cached: the step wrote nothing (every rank raises it, agreed over the group). Its
    one argument: the requests whose hits must be revoked."""

    def __init__(self, req_ids):
        super().__init__(tuple(req_ids))  # the only argument, so the error pickles as it is

    @property
    def req_ids(self) -> tuple[str, ...]:
        return self.args[0]

    def __str__(self) -> str:
        return f"a prefix-cache checkpoint changed since it was cached (hits of {', '.join(self.req_ids)})"


@dataclass(frozen=True)
class CheckpointWrite:
    """After the forward: the recurrent state of `req_id` (its slot of each slot component, at
    position `position`) is in checkpoint slots (copied there after the forward, or, for a
    position inside the entry's slice, written by the forward), and every rank reports their
    checksums. A request may have several in one step, one per position.
    Result processing reads this value (the step's snapshot), never the request's live fields."""

    req_id: str
    position: int
    slots: tuple[tuple[str, int, int], ...]  # (slot component, request's slot, checkpoint slot)
    in_prompt: bool  # the position is within the prompt's prefill (see prefix_nodes.Checkpoint)


@dataclass(frozen=True)
class StepPlan:
    step: int
    entries: tuple[PlanEntry, ...]
    zero_slots: dict[str, tuple[int, ...]]  # freshly allocated slots, zeroed before the forward
    deterministic: bool = False
    forget: tuple[str, ...] = ()  # requests that left before this plan: ranks drop their last token first
    copies: tuple[UnitCopy, ...] = ()  # after zeroing, before the forward
    checkpoints: tuple[CheckpointWrite, ...] = ()  # after the forward
    # steady decodes as columns; the step's rows are these first, then `entries`
    decode: DecodeBlock | None = None
    # grammars rank 0 starts compiling in the background (grammar_gate.py); a plan may carry
    # only these, or nothing at all (an empty step that hears which compiles ended)
    grammars: tuple[GrammarSpec, ...] = ()

    @property
    def num_tokens(self) -> int:
        return sum(len(e.token_ids) for e in self.entries) + self.num_decode

    @property
    def num_decode(self) -> int:
        return len(self.decode) if self.decode is not None else 0

    @property
    def num_rows(self) -> int:
        """Requests the step runs."""
        return self.num_decode + len(self.entries)

    @property
    def req_ids(self) -> tuple[str, ...]:
        """Every request the step runs, in row order."""
        ids = tuple(e.req_id for e in self.entries)
        return self.decode.req_ids + ids if self.decode is not None else ids

    def all_entries(self) -> tuple[PlanEntry, ...]:
        """Every row as a `PlanEntry`, in row order (the decode block's made one by one: for
        what is not on a step's path - failures, tests)."""
        block = tuple(self.decode.entry(k) for k in range(len(self.decode))) if self.decode is not None else ()
        return block + self.entries


@dataclass(frozen=True)
class StepResult:
    """What one step sampled: a token per sampling entry, in plan order (rank 0; other ranks
    answer an empty result), and the logprobs of the sampling rows that asked for them
    (row among the sampling entries -> {"logprob", "top"})."""

    tokens: list[int]
    logprobs: dict[int, dict] = field(default_factory=dict)
    # the plan's checkpoint writes: (req id, position) -> component -> rank -> state hash of the
    # written slot (each rank reports its own; the executor merges them)
    checkpoints: dict[tuple[str, int], dict[str, dict[int, int]]] = field(default_factory=dict)
    # rank 0's background grammar compiles that ended since its last result (grammar_gate.py)
    grammars_ready: tuple[GrammarSpec, ...] = ()
    grammars_failed: tuple[tuple[GrammarSpec, str], ...] = ()  # (spec, why)

    @staticmethod
    def gathered(per_rank: list[StepResult]) -> StepResult:
        """Rank 0's result with every rank's checkpoint checksums merged in."""
        first = per_rank[0]
        for other in per_rank[1:]:
            for key, comps in other.checkpoints.items():
                for name, sums in comps.items():
                    first.checkpoints.setdefault(key, {}).setdefault(name, {}).update(sums)
        return first
