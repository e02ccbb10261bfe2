"""Mamba track-boundary bookkeeping for the prefix cache, as values.

A request checkpoints its recurrent state when a step ends on a track boundary (every
`interval` tokens, a multiple of the page size, and at the prompt's last whole page) into one
of a small ring of checkpoint slots it holds. Two facts are kept apart (the third seed's fix):

- the **producer**: the ring slot the next boundary-crossing forward writes (advanced when a
  step is *planned*);
- the **consumer**: the ring slot and position of the last *committed* checkpoint (set only
  when that step's results are processed).

Planning returns a `TrackWrite` that travels in the step's snapshot (the plan entry); result
processing (`commit`) reads only that snapshot — never the track's producer or its planned
position, which the next step may already have advanced under overlap scheduling. A slot is
never written while it is the consumer or has a write pending, so a committed checkpoint is
never overwritten before the prefix cache takes it (`donate`).

    st = track.start(ring)                      # ring: >= 2 CheckpointSlots
    st, w = track.plan(st, "r1", 0, 64, 100)    # step N: w.position == 64, w travels in the plan
    st, w2 = track.plan(st, "r1", 64, 96, 100)  # step N+1 planned while N runs (96: prompt end page)
    st = track.process(st, w)                   # N's results: the consumer is (w.ring_index, 64)
    st, kept = track.donate(st, fresh)          # the prefix cache takes the checkpoint at 64
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Mapping


@dataclass(frozen=True)
class TrackPolicy:
    """Where checkpoints go: positions that are multiples of `interval`, and the prompt's last
    whole page (the tree is page-granular, so a checkpoint ends on a page boundary)."""

    interval: int = 64
    page_size: int = 16
    # the model writes a checkpoint as of any token inside a step (batch.Capture; not in
    # deterministic mode, where chunks end on fixed cuts): a step that passes a boundary without
    # ending on one checkpoints the last boundary it passed, and chunks need not stop there
    inside: bool = False

    def __post_init__(self):
        if self.page_size < 1 or self.interval < 1 or self.interval % self.page_size:
            raise ValueError(f"mamba track interval must be a positive multiple of the page size "
                             f"({self.page_size}), got {self.interval}")

    def prompt_end(self, prompt_len: int) -> int:
        return prompt_len - prompt_len % self.page_size

    def is_boundary(self, position: int, prompt_len: int) -> bool:
        return position > 0 and (position % self.interval == 0 or position == self.prompt_end(prompt_len))

    def write_at(self, start: int, end: int, prompt_len: int) -> int | None:
        """Where a step running start..end-1 checkpoints: `end` if it is a boundary, else (with
        `inside`) the last boundary it passes, else nowhere (None)."""
        if self.is_boundary(end, prompt_len):
            return end
        if not self.inside:
            return None
        last = (end - 1) // self.interval * self.interval
        pe = self.prompt_end(prompt_len)
        if pe < end:
            last = max(last, pe)
        return last if last > start else None

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
    """Part of a step's snapshot: after this step, the request's state at `position` is written
    into `slots` (ring entry `ring_index`)."""

    req_id: str
    position: int
    ring_index: int
    slots: CheckpointSlots


@dataclass(frozen=True)
class Committed:
    """The consumer: the last committed checkpoint."""

    ring_index: int
    position: int


@dataclass(frozen=True)
class TrackState:
    ring: tuple[CheckpointSlots, ...]
    producer: int = 0  # ring index the next write tries first
    planned: int = 0  # tokens planned so far (the live position: ahead of what is committed)
    pending: tuple[TrackWrite, ...] = ()  # planned, results not processed yet
    consumer: Committed | None = None
    skipped: int = 0  # boundaries passed with every ring slot busy (no checkpoint taken)

    def busy(self) -> frozenset[int]:
        held = {w.ring_index for w in self.pending}
        if self.consumer is not None:
            held.add(self.consumer.ring_index)
        return frozenset(held)


@dataclass(frozen=True)
class Kept:
    """The last committed checkpoint: what a prefix-cache insert takes."""

    position: int
    slots: CheckpointSlots


class MambaTrack:
    """Pure functions over `TrackState` values (one per request)."""

    def __init__(self, policy: TrackPolicy):
        self.policy = policy

    def start(self, ring: tuple[CheckpointSlots, ...], computed: int = 0) -> TrackState:
        """A request holding `ring`, whose state covers `computed` tokens (a hit's length)."""
        if len(ring) < 2:
            raise ValueError("a track needs at least two checkpoint slots (one committed, one being written)")
        return TrackState(tuple(ring), planned=computed)

    def plan(self, st: TrackState, req_id: str, start: int, end: int, prompt_len: int
             ) -> tuple[TrackState, TrackWrite | None]:
        """A step runs positions start..end-1; the write it carries if it checkpoints
        (`TrackPolicy.write_at`)."""
        if start != st.planned or end <= start:
            raise ValueError(f"{req_id}: planned up to {st.planned}, a step cannot run {start}..{end - 1}")
        at = self.policy.write_at(start, end, prompt_len)
        if at is None:
            return replace(st, planned=end), None
        n, busy = len(st.ring), st.busy()
        free = [i % n for i in range(st.producer, st.producer + n) if i % n not in busy]
        if not free:
            return replace(st, planned=end, skipped=st.skipped + 1), None
        w = TrackWrite(req_id, at, free[0], st.ring[free[0]])
        return replace(st, planned=end, producer=(free[0] + 1) % n, pending=st.pending + (w,)), w

    def process(self, st: TrackState, w: TrackWrite | None) -> TrackState:
        """Result processing of one step for this request, from that step's snapshot: `w` is the
        write its plan entry carried (None: the step ended on no boundary)."""
        return st if w is None else self.commit(st, w)

    def commit(self, st: TrackState, w: TrackWrite) -> TrackState:
        """The step that carried `w` completed: its checkpoint is committed. Reads only `w`."""
        if w not in st.pending:
            raise ValueError(f"{w.req_id}: committing a write that is not pending: {w}")
        return replace(st, pending=tuple(p for p in st.pending if p != w),
                       consumer=Committed(w.ring_index, w.position))

    def abandon(self, st: TrackState, w: TrackWrite) -> TrackState:
        """The step that carried `w` will never be committed for this request (it left while the
        step ran): the slot is free again, the consumer unchanged."""
        return replace(st, pending=tuple(p for p in st.pending if p != w))

    def keep(self, st: TrackState) -> Kept | None:
        """The consumer: the slots and position of the last committed checkpoint."""
        if st.consumer is None:
            return None
        return Kept(st.consumer.position, st.ring[st.consumer.ring_index])

    def donate(self, st: TrackState, fresh: CheckpointSlots) -> tuple[TrackState, Kept]:
        """Hand the committed checkpoint to the prefix cache; `fresh` takes its ring place."""
        kept = self.keep(st)
        if kept is None:
            raise ValueError("nothing committed to donate")
        ring = list(st.ring)
        ring[st.consumer.ring_index] = fresh
        return replace(st, ring=tuple(ring), consumer=None), kept

    def release(self, st: TrackState) -> tuple[CheckpointSlots, ...]:
        """Every slot the request holds (to free when it leaves; its pending writes must be
        past the step in flight, as every free is)."""
        return st.ring
