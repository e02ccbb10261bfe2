"""Continuous batching as a pure function: `Scheduler(components, config).schedule(view)`
returns `Scheduled` (the step's plan and the units it takes) or `NeedRoom` (retract these
victims, or give up on a request that can never grow, and ask again).

Decode tokens first, then prefill chunks of running requests and new admissions in
`prefill_order`, under a per-step token budget. Units are taken from the view's free lists, for exactly the positions
a step writes; the engine claims them when it applies the result. In deterministic mode
prefill chunks end at fixed multiples of `prefill_chunk`, so a request's numerics never
depend on what else shares the step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Mapping, NamedTuple, Sequence

import numpy as np

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.indices import IndexSnapshot
from hyrax.actors.engine.lane import Joiner, LaneRows, steady_lane_entry, widened_copy
from hyrax.actors.engine.mamba_track import TrackPolicy
from hyrax.actors.engine.plan import LEFT, START, PlanEntry, SamplingSpec, StepPlan
from hyrax.actors.engine.selection import pick_victims
from hyrax.actors.engine.view import FreePool, RequestView, SchedulerView, Tokens
from hyrax.actors.model.components import captures_mid_step
from hyrax.actors.model.state import TOKEN, WINDOW, ComponentSpec


@dataclass(frozen=True)
class Scheduled:
    plan: StepPlan
    admitted: tuple[str, ...]  # from the queue, in queue order: the engine starts them
    grants: Mapping[str, Mapping[str, tuple[int, ...]]]  # req id -> component -> units taken, in order
    pressure: bool = False  # a request did not fit while frees wait for the step in flight
    short: Mapping[str, int] = field(default_factory=dict)  # units a request that did not fit lacked
    # for the next step's lane (lane.py): the lane rows this plan runs (its decode block), and
    # the steady decodes it planned as entries
    lane: LaneRows | None = None
    joiners: tuple[Joiner, ...] = ()
    # the lane rows that opened a page: req id -> component -> its page table with that page
    # (what claiming the plan sets its indices to)
    opened: Mapping[str, Mapping[str, tuple[int, ...]]] = field(default_factory=dict)


@dataclass(frozen=True)
class NeedRoom:
    victims: tuple[str, ...] = ()  # retract these (memory pressure), then schedule again
    hopeless: tuple[str, ...] = ()  # running alone and still no room: finish with "length"
    short: Mapping[str, int] = field(default_factory=dict)  # what the request that did not fit lacked
    widen: bool = False  # room must be made, and victims are chosen among views: ask again without a lane
    # the step takes more units of a pool than the view lists (a prefix-cache hit's window pages
    # come on top of its chunk's): ask again with this many of each pool's free units listed
    listed: int = 0


class _Pools:
    """Free units as this planning pass takes them (a scratch copy of the view's)."""

    def __init__(self, free: Mapping[str, FreePool]):
        self.count = {n: p.count for n, p in free.items()}
        self.next = {n: p.next for n, p in free.items()}
        self.taken = {n: 0 for n in free}

    def fits(self, need: Mapping[str, int]) -> bool:
        return all(n <= self.count[name] for name, n in need.items())

    def short(self, need: Mapping[str, int]) -> dict[str, int]:
        return {name: n - self.count[name] for name, n in need.items() if n > self.count[name]}

    def unlisted(self, need: Mapping[str, int]) -> int:
        """0 if the view lists the units `need` takes next; else how many units of each pool a
        view must list for this pass to take them (those taken already included)."""
        return max((self.taken[name] + n for name, n in need.items() if self.taken[name] + n > len(self.next[name])),
                   default=0)

    def take(self, name: str, n: int) -> tuple[int, ...]:
        k = self.taken[name]
        out = self.next[name][k : k + n]
        if len(out) != n:
            raise RuntimeError(f"{name}: the view lists {len(self.next[name])} free units, a step took more")
        self.taken[name] += n
        self.count[name] -= n
        return out


_NO_PAGES: Mapping[str, list[int]] = {}  # a step that takes no page (shared; never mutated)


def _sum_needs(need: Mapping[str, int], others) -> dict[str, int]:
    """`need` plus every mapping in `others`, per component."""
    out = dict(need)
    for o in others:
        for name, n in o.items():
            out[name] = out.get(name, 0) + n
    return out


_by_arrival = attrgetter("arrival")


class _Opener(NamedTuple):
    """A lane row whose token opens a page, in the scheduler's queue of decodes."""

    row: int
    arrival: float


def _arrival_of_item(item: tuple) -> float:
    return item[1].arrival


# Prefill order "shortest": prompts that arrived within this many seconds of the oldest prompt
# still to prefill form one group, run shortest remaining first; later arrivals wait behind the
# group in arrival order. A burst of requests (arrival order among them is arbitrary) then gets
# first tokens in the order that minimises their mean wait, while no request is ever passed by
# one that arrived more than the window after it.
SHORTEST_FIRST_WINDOW_S = 0.5


def prefill_order(running: Sequence[RequestView], waiting: Sequence[RequestView], policy: str,
                  window_s: float = SHORTEST_FIRST_WINDOW_S) -> list[tuple[bool, RequestView]]:
    """The step's prefill candidates - running requests with a chunk to run, in arrival order,
    and the waiting ones, in queue order - in the order the step serves them, each as
    (waiting?, request). "fcfs": the running chunks, then the admissions. "shortest": the
    prompts that arrived within `window_s` of the oldest of them, running or waiting alike,
    by remaining tokens (ties by arrival); then the other running chunks by arrival, then the
    other waiting requests in queue order. A burst that reaches the engine over several steps
    (HTTP requests never arrive together) is then still served shortest first: a long prompt
    admitted a step before the short ones does not keep the budget from them. An admission
    that goes before a running chunk must leave that chunk its pages (`Scheduler.schedule`)."""
    marked = [(False, r) for r in running] + [(True, r) for r in waiting]
    if policy == "fcfs" or len(marked) < 2:
        return marked
    cutoff = min(r.arrival for _, r in marked) + window_s

    def key(item: tuple[int, tuple[bool, RequestView]]) -> tuple:
        queue_pos, (is_waiting, r) = item
        if r.arrival <= cutoff:
            return 0, len(r.ids) - r.computed, r.arrival, queue_pos
        return 1, is_waiting, 0.0 if is_waiting else r.arrival, queue_pos
    return [item for _, item in sorted(enumerate(marked), key=key)]


def _decode_first(running: Sequence[RequestView]) -> tuple[list[RequestView], list[RequestView]]:
    """(requests with at most one token to run (decodes), the others (prefill chunks)), each in
    arrival order: the order of the key (pending > 1, arrival), with no key per request."""
    decodes, later = [], []
    for r in sorted(running, key=_by_arrival):
        (later if len(r.ids) - r.computed > 1 else decodes).append(r)
    return decodes, later


class Scheduler:
    def __init__(self, components: tuple[ComponentSpec, ...], config: EngineConfig):
        self.components = components
        self.paged = tuple(c for c in components if c.paged)
        self.slotted = tuple(c for c in components if not c.paged)
        self.slot_names = tuple(c.name for c in self.slotted)
        self.paged_names = tuple(c.name for c in self.paged)
        self.config = config
        self.prefill_role = config.role == "prefill"
        self.decodes_here: frozenset[str] = frozenset()  # the view's (schedule): a prefill replica decodes these
        self.page_size = config.page_size
        # a prefill chunk that crosses the prompt's last whole page ends there (a checkpoint is
        # taken there: prefix cache) unless the model writes checkpoints inside a step; in
        # deterministic mode always, so that a cache hit and a cold run cut the same chunks
        cut = config.deterministic or (config.caches_prefixes and not captures_mid_step(components))
        self.cuts = TrackPolicy(config.mamba_track_interval, config.page_size) if cut else None

    def chunk_len(self, r: RequestView, budget: int) -> int:
        """Tokens `r` runs this step (0: none)."""
        n_ids = len(r.ids)
        pending = n_ids - r.computed
        if pending <= 0 or n_ids - r.num_prompt >= r.params.max_tokens:
            return 0  # nothing to run, or it finishes with the step in flight
        if self.prefill_role and n_ids > r.num_prompt and r.id not in self.decodes_here:
            return 0  # a prefill replica decodes only what it took back: the request is handed off
        if pending == 1:
            return 1 if budget >= 1 else 0
        c = self.config.prefill_chunk
        if self.config.deterministic:
            n = min(pending, c - r.computed % c)
        else:
            n = min(pending, c, budget)
        if self.cuts is not None:
            n = self.cuts.chunk_end(r.computed, r.computed + n, r.num_prompt) - r.computed
        if self.config.deterministic:
            return n if n <= budget else 0
        return n

    def _pages_to_add(self, r: RequestView, end: int) -> dict[str, list[int]]:
        """Page numbers `r` must newly take to write positions < end, per paged component (and,
        for a window component, to hold the live rows before them: a prefix-cache hit copies
        those in)."""
        ps = self.config.page_size
        if end == r.computed + 1 and r.computed % ps:  # a decode token inside a page it already has
            return _NO_PAGES
        out = {}
        for c in self.paged:
            table = r.indices.get(c.name, ())
            first = (r.computed - c.live_rows(r.computed)) // ps if c.kind == WINDOW else r.computed // ps
            out[c.name] = [n for n in range(first, -(-end // ps)) if n >= len(table) or table[n] < 0]
        return out

    def _chunk_need(self, r: RequestView) -> Mapping[str, int]:
        """Pages of each paged component `r`'s next chunk takes at most (a full one)."""
        n = self.chunk_len(r, self.config.max_batch_tokens)
        return {name: len(pages) for name, pages in self._pages_to_add(r, r.computed + n).items()} if n else _NO_PAGES

    def _reserve_ok(self, growing: list[RequestView], need: dict[str, int], pools: _Pools, ratio: float,
                    lane: LaneRows | None = None) -> bool:
        """After a retraction, admit only while pages stay free for the running requests' growth
        (those of the lane included)."""
        if ratio <= 0.0:
            return True
        tokens = sum(max(r.params.max_tokens - r.num_outputs, 0) for r in growing)
        if lane is not None:
            tokens += int(np.maximum(lane.block.max_tokens - lane.block.draws, 0).sum())
        growth = tokens / self.config.page_size
        return all(pools.count[c.name] - need.get(c.name, 0) >= ratio * growth
                   for c in self.components if c.kind == TOKEN)

    def _victims(self, view: SchedulerView, needy: RequestView, need: dict[str, int], planned: set[str],
                 pools: _Pools) -> tuple[str, ...]:
        """The fewest victims, in victim order, whose units make `need` fit (all of them if
        none suffice: they are retracted anyway, as a one-at-a-time loop would)."""
        cands = pick_victims(view.running, len(view.running), exclude=planned | {needy.id} | view.in_flight)
        freed = dict.fromkeys(need, 0)
        for k, v in enumerate(cands):
            for name in freed:
                freed[name] += v.owned(name)
            if all(pools.count[name] + freed[name] >= n for name, n in need.items()):
                return tuple(c.id for c in cands[: k + 1])
        return tuple(c.id for c in cands)

    def schedule(self, view: SchedulerView) -> Scheduled | NeedRoom:
        budget = self.config.max_batch_tokens
        self.decodes_here = view.decodes_here
        pools = _Pools(view.free)
        entries: list[PlanEntry] = []
        grants: dict[str, dict[str, tuple[int, ...]]] = {}
        planned: set[str] = set()
        pressure = False
        short: dict[str, int] = {}
        lane = view.lane
        joiners: list[Joiner] = []  # steady decodes planned here that the lane carries on next step
        decodes, later = _decode_first(view.running)
        if lane is not None:  # the lane's rows run first, one token each
            if len(lane.block) + len(decodes) > budget:  # the budget decides who decodes: in arrival order
                return NeedRoom(widen=True)
            budget -= len(lane.block)
        admitted: list[RequestView] = []
        admitting = view.admit_new
        # the next chunk's pages of each running request not planned yet: an admission planned
        # before it leaves them free, so that admitting never costs a running request its pages
        # (none to admit, as in most steps: nothing to work out)
        unplanned = {r.id: self._chunk_need(r) for r in later} if admitting and view.waiting else {}
        queue = [(False, r) for r in decodes]
        opened: dict[int, tuple[int, ...]] = {}  # lane row -> the page it opens of each paged pool
        if lane is not None and lane.openers:
            if not self._can_open(lane):
                return NeedRoom(widen=True)
            # the rows opening a page take it in arrival order with the other decodes, as views would
            queue = sorted(queue + list(zip(repeat(None), map(_Opener, lane.openers, lane.arrivals))),
                           key=_arrival_of_item)
        queue += prefill_order(later, view.waiting, self.config.prefill_order)
        for waiting, r in queue:
            if waiting is None:  # a lane row opens a page: one of each paged pool, or a full view decides
                need = dict.fromkeys(self.paged_names, 1)
                if not pools.fits(need):
                    return NeedRoom(widen=True)
                if unlisted := pools.unlisted(need):
                    return NeedRoom(listed=unlisted)
                opened[r.row] = tuple(pools.take(name, 1)[0] for name in self.paged_names)
                continue
            if waiting:
                if not admitting:
                    continue
                if budget <= 0 or view.num_running + len(admitted) >= self.config.max_running:
                    admitting = False
                    continue
                n = self.chunk_len(r, budget)
                if n == 0:
                    admitting = False
                    continue
                add = self._pages_to_add(r, r.computed + n)
                need = {name: len(pages) for name, pages in add.items()} | {c.name: 1 for c in self.slotted}
                held = _sum_needs(need, unplanned.values())
                if not pools.fits(held):
                    short = short or pools.short(held)
                    admitting = False
                    continue
                if not self._reserve_ok([*view.running, *admitted], need, pools, view.reserve_ratio, lane):
                    admitting = False
                    continue
                if unlisted := pools.unlisted(need):
                    return NeedRoom(listed=unlisted)
                slots = {c.name: pools.take(c.name, 1) for c in self.slotted}
                entries.append(self._entry(r, n, add, slots, pools, grants))
                admitted.append(r)
                budget -= n
                continue
            unplanned.pop(r.id, None)
            if budget >= 1:
                e = self._steady_decode(r)
                if e is not None:
                    entries.append(e)
                    planned.add(r.id)
                    budget -= 1
                    if type(r.indices) is IndexSnapshot and steady_lane_entry(e):
                        joiners.append(Joiner(e, r.indices, r.params.max_tokens,
                                              bool(r.params.stop or r.params.stop_token_ids)))
                    continue
            n = self.chunk_len(r, budget)
            if n == 0:
                continue
            add = self._pages_to_add(r, r.computed + n)
            need = {name: len(pages) for name, pages in add.items()} if add else _NO_PAGES
            if need and not pools.fits(need):
                lack = pools.short(need)
                if view.in_flight:  # frees wait for the step in flight: plan again after it
                    pressure = True
                    short = short or lack
                    continue
                if lane is not None:  # victims may be lane rows, which have no view here
                    return NeedRoom(short=lack, widen=True)
                victims = self._victims(view, r, need, planned, pools)
                if victims:
                    return NeedRoom(victims=victims, short=lack)
                if len(view.running) == 1 and not entries and not view.offers_held:
                    return NeedRoom(hopeless=(r.id,), short=lack)
                short = short or lack
                continue
            if need and (unlisted := pools.unlisted(need)):
                return NeedRoom(listed=unlisted)
            e = self._entry(r, n, add, {}, pools, grants)
            entries.append(e)
            planned.add(r.id)
            budget -= n
            if n == 1 and len(r.ids) > r.num_prompt and type(r.indices) is IndexSnapshot and steady_lane_entry(e):
                # a decode that opens a page: next step it decodes inside that page, so it joins
                # the lane now, with the indices the engine's claim of this plan gives it (None)
                # rather than through one more step on the general path
                joiners.append(Joiner(e, None, r.params.max_tokens, bool(r.params.stop or r.params.stop_token_ids)))
        tables = {}
        if opened and self.paged:  # no paged component: a page start takes nothing (no grant, as an entry's)
            lane, tables = self._opened(lane, opened, grants)
        zero = {c.name: tuple(grants[r.id][c.name][0] for r in admitted) for c in self.slotted}
        plan = StepPlan(view.step, tuple(entries), zero, self.config.deterministic,
                        decode=lane.block if lane is not None else None)
        return Scheduled(plan, tuple(r.id for r in admitted), grants, pressure, short, lane, tuple(joiners), tables)

    def _can_open(self, lane: LaneRows) -> bool:
        """Whether each lane row opening a page needs exactly that page of each paged component:
        its table (the row's snapshot's) ends before it, and a window's live pages before it
        are all held (what `_pages_to_add` finds for such a decode); otherwise a full view
        plans the step. A few rows a step: in Python, no array operation."""
        ps = self.page_size
        starts = lane.block.ints[list(lane.openers), START].tolist()
        for k, start in zip(lane.openers, starts):
            snap, page = lane.snaps[k], start // ps
            for c in self.paged:
                table = snap.get(c.name)
                if table is None or len(table) != page:
                    return False
                # a window's first live row and every page after it held
                if c.kind == WINDOW and min(table[(start - c.live_rows(start)) // ps:], default=0) < 0:
                    return False
        return True

    def _opened(self, lane: LaneRows, opened: dict[int, tuple[int, ...]], grants: dict) -> tuple[LaneRows, dict]:
        """The lane with each opening row's page (`opened`: row -> a unit per paged component, in
        `paged_names` order) in its tables (new arrays), the pages recorded in `grants`, and each
        such row's tables as its indices become ({req id: {name: table}})."""
        block, names = lane.block, self.paged_names
        ks = list(opened)
        tables, grown = {}, []
        for k, got in opened.items():
            rid, snap = block.req_ids[k], lane.snaps[k]
            grants[rid] = {name: (unit,) for name, unit in zip(names, got)}
            tables[rid] = {name: snap[name] + (unit,) for name, unit in zip(names, got)}
            grown.append([len(tables[rid][name]) for name in names])
        at = [LEFT + 1 + len(block.slot_names) + list(block.tables).index(n) for n in names]
        ints = block.ints.copy()
        ints[np.array(ks)[:, None], at] = grown  # each row's page-table lengths, one longer
        new_tables = dict(block.tables)
        for j, name in enumerate(names):
            t = block.tables[name]
            cols = [row[j] - 1 for row in grown]
            width = max(t.shape[1], max(cols) + 1)
            t = new_tables[name] = widened_copy(t, width)
            t[ks, cols] = [got[j] for got in opened.values()]
        block = dataclasses.replace(block, ints=ints, tables=new_tables)
        return lane._replace(block=block), tables

    def _steady_decode(self, r: RequestView) -> PlanEntry | None:
        """Most entries of a step: one decode token inside a page `r` holds, which takes no unit
        (the view's tables and slots are the entry's as they are). None: not that case (the
        general path decides). The same entry the general path would make, for less work."""
        ids, start = r.ids, r.computed
        end = len(ids)
        draw = end - r.num_prompt
        p = r.params
        if (end - start != 1 or not start % self.page_size or draw >= p.max_tokens
                or (self.prefill_role and draw and r.id not in self.decodes_here)):
            return None
        idx = r.indices  # a view made by hand may hold a plain mapping: snapshot it here
        split = (idx if type(idx) is IndexSnapshot else IndexSnapshot(idx)).split(self.paged_names, self.slot_names)
        if split is None:
            return None
        tables, slots = split  # the request's last steady entry's dicts, while its indices are unchanged
        token = ids.last() if type(ids) is Tokens else ids[start:]  # a view made by hand holds a tuple
        return PlanEntry(r.id, token, start, tables, slots, SamplingSpec.of(p, r.seed, draw, ids))

    def _entry(self, r: RequestView, n: int, add: Mapping[str, list[int]], slots: dict[str, tuple[int, ...]],
               pools: _Pools, grants: dict) -> PlanEntry:
        """The plan entry running `n` tokens of `r`, taking the pages in `add` (and `slots`, newly
        taken for an admission); what it took is recorded in `grants` (nothing taken: no record)."""
        got = dict(slots)
        tables = self._tables(r, add, pools, got)
        taken = {name: units for name, units in got.items() if units}
        if taken:
            grants[r.id] = taken
        start, ids = r.computed, r.ids
        end = start + n
        sample = SamplingSpec.of(r.params, r.seed, len(ids) - r.num_prompt, ids) if end == len(ids) else None
        return PlanEntry(r.id, ids[start:end], start, tables,
                         {name: (slots.get(name) or r.indices[name])[0] for name in self.slot_names}, sample)

    def _tables(self, r: RequestView, add: Mapping[str, list[int]], pools: _Pools, got: dict) -> dict:
        """`r`'s page tables with the pages in `add` taken from `pools` (recorded in `got`)."""
        tables = {}
        for c in self.paged:
            if not add.get(c.name):  # no new page: the view's table (a tuple) is the entry's as it is
                tables[c.name] = r.indices.get(c.name, ())
                continue
            table = list(r.indices.get(c.name, ()))
            got[c.name] = pools.take(c.name, len(add[c.name]))
            for number, unit in zip(add[c.name], got[c.name]):
                table.extend([-1] * (number + 1 - len(table)))
                table[number] = unit
            tables[c.name] = tuple(table)
        return tables
