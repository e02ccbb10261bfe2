"""Mamba track-boundary bookkeeping for the prefix cache, as values.

A request checkpoints its recurrent state at track boundaries (every `interval` tokens, a
multiple of the page size, and at the prompt's last whole page). Each checkpoint write takes
fresh checkpoint slots when its step is *planned* and owns them alone until the step's results
are processed: there the prefix cache adopts them (`insert`) or they are freed. A slot is never
written twice for one allocation, so no later step can overwrite a checkpoint before the cache
takes it, whatever the overlap depth (the third seed's race, impossible by construction: there
is no shared "slot being written" pointer that planning advances and result processing reads).

Planning returns `TrackWrite`s that travel in the step's snapshot (the plan entry); result
processing (`commit`) reads only that snapshot - never the track's planned position, which the
next step may already have advanced under overlap scheduling.

    st = track.start()                                   # a request at position 0
    st, ws = track.plan(st, "r1", 0, 256, 300, take)     # step N: writes at 64, 128, 192, 256
    st, ws2 = track.plan(st, "r1", 256, 300, 300, take)  # step N+1 planned while N runs (288)
    st, done = track.commit(st, ws[0])                   # N's results: the cache adopts done.slots
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Mapping, Sequence


@dataclass(frozen=True)
class TrackPolicy:
    """Where checkpoints go: positions that are multiples of `interval`, and the prompt's last
    whole page (the tree is page-granular, so a checkpoint ends on a page boundary)."""

    interval: int = 64
    page_size: int = 16
    # the model writes a checkpoint as of any token inside a step (batch.Capture; not in
    # deterministic mode, where chunks end on fixed cuts): a step checkpoints every boundary it
    # passes, and chunks need not stop at any of them
    inside: bool = False

    def __post_init__(self):
        if self.page_size < 1 or self.interval < 1 or self.interval % self.page_size:
            raise ValueError(f"mamba track interval must be a positive multiple of the page size "
                             f"({self.page_size}), got {self.interval}")

    def prompt_end(self, prompt_len: int) -> int:
        return prompt_len - prompt_len % self.page_size

    def is_boundary(self, position: int, prompt_len: int) -> bool:
        return position > 0 and (position % self.interval == 0 or position == self.prompt_end(prompt_len))

    def writes_at(self, start: int, end: int, prompt_len: int) -> tuple[int, ...]:
        """Where a step running start..end-1 checkpoints, in order: `end` if it is a boundary,
        and (with `inside`) every boundary it passes before that."""
        if not self.inside:
            return (end,) if self.is_boundary(end, prompt_len) else ()
        i = self.interval
        out = list(range((start // i + 1) * i, end + 1, i))
        pe = self.prompt_end(prompt_len)
        if start < pe <= end and pe % i:
            out.append(pe)
            out.sort()
        return tuple(out)

    def chunk_end(self, start: int, end: int, prompt_len: int) -> int:
        """Where a prefill chunk meant to run start..end-1 stops: at the prompt's last whole page
        if it crosses it (a checkpoint there lets a repeated or extended prompt hit), else at `end`.
        Checkpoints are otherwise taken where chunks end on a multiple of the interval: cutting
        chunks at every boundary made prompts take more, smaller steps."""
        p = self.prompt_end(prompt_len)
        return p if start < p < end else end

    def deterministic_cuts(self, prompt_len: int, total: int, chunk: int) -> set[int]:
        """Where deterministic prefill of `total` tokens stops each chunk (fixed multiples of
        `chunk`): the positions a request's own computation passes through a chunk boundary, so
        the only places a cached state is bit-identical to its own."""
        cuts, pos = set(), 0
        while pos < total:
            pos = self.chunk_end(pos, min(total, (pos // chunk + 1) * chunk), prompt_len)
            cuts.add(pos)
        return cuts

    def next_boundary(self, position: int, prompt_len: int) -> int:
        """The first boundary after `position` (a scheduler ends prefill chunks there)."""
        b = (position // self.interval + 1) * self.interval
        end = self.prompt_end(prompt_len)
        return end if position < end < b else b


@dataclass(frozen=True)
class CheckpointSlots:
    """One checkpoint slot per slot component (each in that component's checkpoint pool)."""

    units: tuple[tuple[str, int], ...]

    @classmethod
    def of(cls, slots: Mapping[str, int]) -> CheckpointSlots:
        return cls(tuple(sorted(slots.items())))

    def as_dict(self) -> dict[str, int]:
        return dict(self.units)


@dataclass(frozen=True)
class TrackWrite:
    """Part of a step's snapshot: after this step, the request's state at `position` is in
    `slots`, taken for this write alone."""

    req_id: str
    position: int
    slots: CheckpointSlots


@dataclass(frozen=True)
class TrackState:
    planned: int = 0  # tokens planned so far (the live position: ahead of what is committed)
    pending: tuple[TrackWrite, ...] = ()  # planned, results not processed yet (they own their slots)
    skipped: int = 0  # boundaries passed without free checkpoint slots (no checkpoint taken)


class MambaTrack:
    """Pure functions over `TrackState` values (one per request)."""

    def __init__(self, policy: TrackPolicy):
        self.policy = policy

    def start(self, computed: int = 0) -> TrackState:
        """A request whose state covers `computed` tokens (a hit's length)."""
        return TrackState(planned=computed)

    def plan(self, st: TrackState, req_id: str, start: int, end: int, prompt_len: int,
             take: Callable[[int], Sequence[CheckpointSlots]]) -> tuple[TrackState, tuple[TrackWrite, ...]]:
        """A step runs positions start..end-1; the writes it carries (`TrackPolicy.writes_at`),
        each with the fresh slots `take(n)` gave (at most n sets; when it gives fewer, the last
        positions get them: the longest prefixes, which a hit on an earlier one would also
        match less of)."""
        if start != st.planned or end <= start:
            raise ValueError(f"{req_id}: planned up to {st.planned}, a step cannot run {start}..{end - 1}")
        at = self.policy.writes_at(start, end, prompt_len)
        if not at:
            return replace(st, planned=end), ()
        got = tuple(take(len(at)))[:len(at)]
        ws = tuple(TrackWrite(req_id, p, s) for p, s in zip(at[len(at) - len(got):], got))
        return replace(st, planned=end, pending=st.pending + ws, skipped=st.skipped + len(at) - len(got)), ws

    def commit(self, st: TrackState, w: TrackWrite) -> tuple[TrackState, TrackWrite]:
        """The step that carried `w` completed: returns the written checkpoint, whose slots are
        now the caller's to hand to the cache (or free). Reads only `w`, the step's snapshot."""
        if w not in st.pending:
            raise ValueError(f"{w.req_id}: committing a write that is not pending: {w}")
        return replace(st, pending=tuple(p for p in st.pending if p != w)), w

    def release(self, st: TrackState) -> tuple[CheckpointSlots, ...]:
        """The slots of every write still pending (to free when the request leaves: through the
        one free point, after the step in flight that may still write them)."""
        return tuple(w.slots for w in st.pending)
