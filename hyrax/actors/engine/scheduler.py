"""Continuous batching: which requests run this step, with how many tokens.

Decode tokens first, then prefill chunks of running requests, then new admissions, under a
per-step token budget. Pages are allocated here, for exactly the positions a step writes;
a running request that cannot get a page makes room by retracting victims (memory
pressure). In deterministic mode prefill chunks end at fixed multiples of `prefill_chunk`,
so a request's numerics never depend on what else shares the step.
"""
from __future__ import annotations

from typing import Callable

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.plan import PlanEntry, SamplingSpec, StepPlan
from hyrax.actors.engine.request import Request, State
from hyrax.actors.model.state import ComponentSpec


PLACEHOLDER = -1  # "the token this request samples in the step still in flight" (ranks fill it in)


class Scheduler:
    def __init__(self, components: tuple[ComponentSpec, ...], config: EngineConfig,
                 allocators: dict[str, IndexAllocator]):
        self.components = components
        self.config = config
        self.alloc = allocators
        self.reserve_ratio = 0.0  # adaptive admission: raised by memory pressure, decays per step
        # overlap scheduling: req id -> (computed, outputs) once the in-flight step commits.
        # Read here instead of advancing the requests' own fields ahead of their results.
        self.ahead: dict[str, tuple[int, int]] = {}

    # ---- a request as the next step will find it --------------------------------------
    def computed(self, req: Request) -> int:
        a = self.ahead.get(req.id)
        return a[0] if a else req.num_computed

    def n_outputs(self, req: Request) -> int:
        a = self.ahead.get(req.id)
        return a[1] if a else len(req.output_ids)

    def pending(self, req: Request) -> int:
        return len(req.prompt_ids) + self.n_outputs(req) - self.computed(req)

    # ---- sizing ----------------------------------------------------------------------
    def chunk_len(self, req: Request, budget: int) -> int:
        pending = self.pending(req)
        if pending <= 0 or self.n_outputs(req) >= req.params.max_tokens:
            return 0  # nothing to run, or it finishes with the step in flight
        if self.config.role == "prefill" and self.n_outputs(req) >= 1:
            return 0  # a prefill replica never decodes: the request is handed off
        if pending == 1:
            return 1 if budget >= 1 else 0
        c = self.config.prefill_chunk
        if self.config.deterministic:
            n = min(pending, c - self.computed(req) % c)
            return n if n <= budget else 0
        return min(pending, c, budget)

    def _pages_to_add(self, req: Request, end: int) -> dict[str, list[int]]:
        """Page numbers a request must newly allocate to write positions < end."""
        ps = self.config.page_size
        out = {}
        for c in self.components:
            if not c.paged:
                continue
            table = req.indices.get(c.name, [])
            first = self.computed(req) // ps
            out[c.name] = [n for n in range(first, -(-end // ps)) if n >= len(table) or table[n] < 0]
        return out

    def _fits(self, need: dict[str, int]) -> bool:
        return all(self.alloc[name].can_allocate(n) for name, n in need.items())

    def _allocate_pages(self, req: Request, add: dict[str, list[int]]) -> None:
        for name, numbers in add.items():
            got = self.alloc[name].allocate(req.id, len(numbers))
            table = req.indices.setdefault(name, [])
            for n, page in zip(numbers, got):
                while len(table) <= n:
                    table.append(-1)
                table[n] = page

    def _reserve_ok(self, running: list[Request], add: dict[str, int]) -> bool:
        """After a retraction, admit only while pages stay free for the running requests' growth."""
        if self.reserve_ratio <= 0.0:
            return True
        ps = self.config.page_size
        growth = sum(max(r.params.max_tokens - self.n_outputs(r), 0) for r in running) / ps
        for c in self.components:
            if c.kind == "token":
                if self.alloc[c.name].num_free - add.get(c.name, 0) < self.reserve_ratio * growth:
                    return False
        return True

    # ---- the step --------------------------------------------------------------------
    def schedule(self, step: int, running: list[Request], waiting: list[Request],
                 make_room: Callable[[Request, dict[str, int], set[str]], bool],
                 on_no_room: Callable[[Request], None], admit_new: bool) -> tuple[StepPlan, list[Request]]:
        """Returns the plan and the requests admitted from `waiting`, in queue order (their
        indices are allocated; the engine moves them to running)."""
        budget = self.config.max_batch_tokens
        entries: list[PlanEntry] = []
        planned: set[str] = set()
        zero: dict[str, list[int]] = {c.name: [] for c in self.components if not c.paged}
        for req in sorted(running, key=lambda r: (self.pending(r) > 1, r.arrival)):
            if req.state != State.RUNNING:
                continue  # retracted as a victim earlier in this loop
            n = self.chunk_len(req, budget)
            if n == 0:
                continue
            add = self._pages_to_add(req, self.computed(req) + n)
            need = {k: len(v) for k, v in add.items()}
            if not self._fits(need) and not make_room(req, need, planned):
                if len([r for r in running if r.state == State.RUNNING]) == 1 and not entries:
                    on_no_room(req)  # alone and still no room: it can never grow
                continue
            self._allocate_pages(req, add)
            entries.append(self._entry(req, n))
            planned.add(req.id)
            budget -= n
        admitted: list[Request] = []
        n_running = sum(1 for r in running if r.state == State.RUNNING)
        queue = iter(list(waiting))
        while admit_new and budget > 0 and n_running + len(admitted) < self.config.max_running:
            req = next(queue, None)
            if req is None:
                break
            n = self.chunk_len(req, budget)
            if n == 0:
                break
            add = self._pages_to_add(req, self.computed(req) + n)
            need = {k: len(v) for k, v in add.items()}
            for c in self.components:
                if not c.paged:
                    need[c.name] = 1
            if not self._fits(need) or not self._reserve_ok(running + admitted, need):
                break
            for c in self.components:
                if not c.paged:
                    req.indices[c.name] = self.alloc[c.name].allocate(req.id, 1)
                    zero[c.name].extend(req.indices[c.name])
            self._allocate_pages(req, add)
            admitted.append(req)  # the engine starts them in the request table
            entries.append(self._entry(req, n))
            budget -= n
        self.reserve_ratio = max(0.0, self.reserve_ratio - 0.02)
        plan = StepPlan(step, tuple(entries), {k: tuple(v) for k, v in zero.items()}, self.config.deterministic)
        return plan, admitted

    def _entry(self, req: Request, n: int) -> PlanEntry:
        start = self.computed(req)
        n_out = self.n_outputs(req)
        ids = req.all_ids + [PLACEHOLDER] * (n_out - len(req.output_ids))
        sample = None
        if start + n == len(ids):
            sample = SamplingSpec.of(req.params, req.seed, n_out, ids)
        return PlanEntry(
            req_id=req.id, token_ids=tuple(ids[start : start + n]), start=start,
            page_tables={c.name: tuple(req.indices[c.name]) for c in self.components if c.paged},
            slots={c.name: req.indices[c.name][0] for c in self.components if not c.paged},
            sample=sample,
        )
