"""The engine of one role replica: orchestration of the request table, the scheduler, the
allocators, retraction and hand-offs.

One step is `schedule() -> StepPlan`, `executor.submit(plan)`, `commit(plan, tokens)`, run as a
pipeline of depth 1 (synchronous) or 2 (overlap: step N+1 is submitted before step N is
committed). Commit reads the plan, never live request fields. Every release of device
indices, whatever the reason a request leaves, goes through one point (`_release`), which
defers it past the step in flight. Ray-free: the same engine drives an in-process rank
(`hyrax generate`, unit tests) or TP rank actors (the Ray coordinator).
"""
from __future__ import annotations

import dataclasses
import itertools
import random
import time
import uuid
from dataclasses import dataclass

from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.executor import Executor, StepResult
from hyrax.actors.engine.lifecycle import Outcome, RequestTable
from hyrax.actors.engine.moves import Place, make_moves
from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.pools import PoolSizes
from hyrax.actors.engine.request import Request, SamplingParams, State
from hyrax.actors.engine.scheduler import NeedRoom, Scheduled, Scheduler
from hyrax.actors.engine.selection import pick_victims
from hyrax.actors.engine.stats import EngineStats
from hyrax.actors.engine.statecopy import pages_needed, releasable_pages
from hyrax.actors.engine.transfer import Transfers
from hyrax.actors.engine.view import build_view
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.state import ComponentSpec, WINDOW


@dataclass
class StepOutput:
    req_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    handoff: dict | None = None  # set when the request was offered to another replica
    logprobs: list[dict] | None = None  # one per new token, when the request asked for them


class Engine:
    def __init__(self, components: tuple[ComponentSpec, ...], sizes: PoolSizes, host_rows: dict[str, int],
                 executor: Executor, config: EngineConfig, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), decode=None):
        self.components = components
        self.config = config
        self.executor = executor
        self.vocab_size = vocab_size
        self.max_model_len = min(max_model_len, config.max_model_len or max_model_len)
        self.eos = set(eos_token_ids)
        self.decode = decode  # token ids -> text, for stop strings
        self.sizes = sizes
        self.alloc = {c.name: IndexAllocator(c.name, sizes.units[c.name]) for c in components}
        self.host_alloc = {c.name: IndexAllocator(f"host_{c.name}", max(host_rows.get(c.name, 0), 1))
                           for c in components}
        self.stats = EngineStats()
        self.table = RequestTable()
        self.scheduler = Scheduler(components, config)
        self.reserve_ratio = 0.0  # adaptive admission: raised by memory pressure, decays per step
        self.moves = make_moves(components, config, executor, self.alloc, self.host_alloc, self.stats,
                                release=self._release)
        self.transfers = Transfers(self)
        self.step_count = 0
        self.forced_interval = config.forced_retraction_interval
        self._outputs: list[StepOutput] = []
        self._ids = itertools.count()
        self.finished_requests: dict[str, Request] = {}
        # the pipeline: the step the ranks are running (depth 2 only), frees waiting for it,
        # and requests whose last token the ranks may forget
        self._inflight: tuple[StepPlan, object] | None = None
        self._frees: list[tuple[int, str, dict[str, list[int]]]] = []  # (step it waits for, owner, indices)
        self._forget: list[str] = []
        self._pressure = False

    # ---- the request table, as the rest of the code reads it -----------------------------
    @property
    def requests(self) -> dict[str, Request]:
        return self.table.requests

    @property
    def running(self) -> list[Request]:
        return self.table.running

    @property
    def waiting(self) -> list[Request]:
        return self.table.waiting

    @property
    def retracted(self) -> list[Request]:
        return self.table.retracted

    @property
    def handoffs(self) -> dict[str, Request]:
        return self.table.offered

    # ---- request API -------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue a request. Bad input raises HyraxInputError and changes nothing."""
        params.validate(self.vocab_size)
        if not prompt_ids:
            raise HyraxInputError("the prompt is empty")
        if any((not isinstance(t, int)) or t < 0 or t >= self.vocab_size for t in prompt_ids):
            raise HyraxInputError(f"prompt token ids must be integers in [0, {self.vocab_size})")
        if len(prompt_ids) >= self.max_model_len:
            raise HyraxInputError(
                f"prompt has {len(prompt_ids)} tokens; the model's context is {self.max_model_len} tokens"
            )
        ps = self.config.page_size
        for c in self.components:
            if c.paged:
                # the prompt (plus the first token) must fit once every other request is gone
                need = pages_needed(c, len(prompt_ids) + 1, ps) if c.kind != WINDOW else \
                    pages_needed(c, min(len(prompt_ids) + 1, c.window + self.config.prefill_chunk), ps)
                if need > self.sizes.units[c.name]:
                    raise HyraxInputError(
                        f"prompt of {len(prompt_ids)} tokens can never fit the {c.name} pool "
                        f"({self.sizes.units[c.name] * ps} tokens)"
                    )
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        if rid in self.table:
            raise HyraxInputError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        self.table.admit(Request(rid, list(prompt_ids), params, seed))
        self.stats.prompt_tokens += len(prompt_ids)
        return rid

    def abort(self, req_id: str) -> bool:
        """End a request wherever it is here (waiting, running, retracted, offered)."""
        req = self.table.get(req_id)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.table)

    def has_work(self) -> bool:
        """Something a step can advance: running or waiting requests, a retracted one that
        may resume, or a step in flight. Held and offered requests wait for a call."""
        return bool(self.running or self.waiting or self._inflight is not None
                    or any(not r.hold for r in self.retracted))

    # ---- retraction API (admin) --------------------------------------------------------
    def retract(self, req_ids: list[str], mode: str | None = None, hold: bool = False,
                trigger: str = "admin") -> dict[str, Outcome]:
        """Retract running requests by id. Returns id -> the backup mode used, or a refusal."""
        if mode is not None and mode not in ("cpu_tensor", "host_pool", "recompute"):
            raise HyraxInputError("mode must be cpu_tensor, host_pool or recompute")
        self.sync()  # a retracted request has no step in flight
        out = {}
        for rid in req_ids:
            req = self.table.get(rid)
            if req is None:
                out[rid] = Outcome.UNKNOWN
            elif req.state != State.RUNNING:
                out[rid] = Outcome.NOT_RUNNING
            else:
                out[rid] = self._retract(req, trigger, mode, hold)
        return out

    def resume(self, req_ids: list[str]) -> dict[str, Outcome]:
        """Release held requests; they are restored now, or as soon as memory allows (QUEUED)."""
        self.sync()
        out = {}
        for rid in req_ids:
            req = self.table.get(rid)
            if req is None or req.state != State.RETRACTED:
                out[rid] = Outcome.NOT_RETRACTED if req is not None else Outcome.UNKNOWN
                continue
            req.hold = False
            result = self._restore(req)
            out[rid] = Outcome.QUEUED if result == Outcome.NO_CAPACITY else result
        return out

    def set_forced_retraction(self, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise HyraxInputError("interval must be an integer >= 0 (0 = off)")
        self.forced_interval = interval

    def _retract(self, req: Request, trigger: str, mode: str | None, hold: bool) -> Outcome:
        used = self.moves.retract(req, trigger, mode)
        self.table.retract(req, hold)
        req.retracted_at_step = self.step_count
        return Outcome(used)

    def _restore(self, req: Request) -> Outcome:
        result = self.moves.load(req)
        if result == Outcome.VERIFIED:
            self.table.restore(req)
        elif result != Outcome.NO_CAPACITY:
            self.table.requeue(req)  # rebuilt by prefill: first in line
        return result

    # ---- the pipeline ------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """One step of the pipeline. Depth 1: plan, run and commit step N. Depth 2 (overlap):
        plan and submit step N, then commit step N-1 while the ranks run N. Retractions,
        restores and memory pressure need requests with no step in flight: those steps
        commit the step in flight first."""
        self.step_count += 1
        self.stats.steps += 1
        forced = bool(self.forced_interval) and self.step_count % self.forced_interval == 0
        resumable = any(not r.hold for r in self.retracted)
        if not self.config.overlap or forced or resumable or self._pressure:
            self.sync()
            self._pressure = False
        self._auto_resume()
        if forced:
            for v in pick_victims(self.running, 1):
                self._retract(v, "forced", None, False)
        plan = self._plan()
        handle = self.executor.submit(plan) if plan.entries else None
        prev, self._inflight = self._inflight, ((plan, handle) if handle is not None else None)
        if prev is not None:
            self._commit_step(*prev)  # step N-1, while the ranks run step N
        if not self.config.overlap:
            self.sync()
        out, self._outputs = self._outputs, []
        return out

    def _plan(self) -> StepPlan:
        """Ask the scheduler, make the room it needs (retract victims, give up on a request
        that can never grow) and ask again; then claim what the plan takes."""
        while True:
            got = self.scheduler.schedule(build_view(
                self.step_count, self.running, self.waiting, self.alloc,
                self._inflight[0] if self._inflight is not None else None, self.config.max_running,
                self.config.max_batch_tokens, not any(not r.hold for r in self.retracted), self.reserve_ratio))
            if isinstance(got, Scheduled):
                break
            self._make_room(got)
        self._pressure = got.pressure
        self.reserve_ratio = max(0.0, self.reserve_ratio - 0.02)
        self._claim(got)
        plan = got.plan
        if self._forget and plan.entries:
            plan = dataclasses.replace(plan, forget=tuple(self._forget))
            self._forget = []
        return plan

    def _make_room(self, need: NeedRoom) -> None:
        for rid in need.victims:
            self._retract(self.table.get(rid), "memory", None, False)
            self.reserve_ratio = 1.0
        for rid in need.hopeless:
            self._finish(self.table.get(rid), "length")

    def _claim(self, got: Scheduled) -> None:
        """The plan's units become its requests' (in the order the scheduler took them); the
        admitted requests start running."""
        for e in got.plan.entries:
            req = self.table.get(e.req_id)
            for name, units in got.grants.get(e.req_id, {}).items():
                self.alloc[name].claim(req.id, units)
            req.indices.update({name: list(t) for name, t in e.page_tables.items()})
            req.indices.update({name: [slot] for name, slot in e.slots.items()})
        now = time.monotonic()
        for rid in got.admitted:
            r = self.table.get(rid)
            self.table.start(r)
            if r.first_scheduled_at is None:
                r.first_scheduled_at = now
                self.stats.queue_seconds.append(now - r.arrival)

    def has_inflight(self) -> bool:
        return self._inflight is not None

    def in_flight_ids(self) -> set[str]:
        """Requests the step in flight runs."""
        return {e.req_id for e in self._inflight[0].entries} if self._inflight else set()

    def sync(self) -> None:
        """Collect and commit the step in flight; the frees that waited for it happen then."""
        if self._inflight is None:
            return
        plan, handle = self._inflight
        self._inflight = None
        self._commit_step(plan, handle)

    def _commit_step(self, plan: StepPlan, handle) -> None:
        self.commit(plan, self.executor.collect(handle))
        self._free_ready(plan.step)

    # ---- the one free point --------------------------------------------------------------
    def _release(self, owner: str, indices: dict[str, list[int]]) -> None:
        """Give device indices back: now, or after the step in flight (which may still write
        them). Every reason a request gives up state comes here."""
        indices = {n: [i for i in idx if i >= 0] for n, idx in indices.items()}
        if self._inflight is not None:
            self._frees.append((self._inflight[0].step, owner, indices))
        else:
            self._free_now(owner, indices)

    def _free_now(self, owner: str, indices: dict[str, list[int]]) -> None:
        for name, idx in indices.items():
            if idx:
                self.alloc[name].free(owner, idx)

    def _free_ready(self, done_step: int) -> None:
        keep = []
        for waits_for, owner, indices in self._frees:
            if waits_for <= done_step:
                self._free_now(owner, indices)
            else:
                keep.append((waits_for, owner, indices))
        self._frees = keep

    # ---- results -------------------------------------------------------------------------
    def commit(self, plan: StepPlan, result: StepResult) -> None:
        """Apply a step's results using the step's own plan snapshot."""
        tokens, lps = result.tokens, result.logprobs
        row = iter(range(len(tokens)))
        it = iter(tokens)
        new: dict[str, list[int]] = {}
        new_lps: dict[str, list[dict]] = {}
        done: list[tuple[Request, str]] = []
        now = time.monotonic()
        for e in plan.entries:
            tok = next(it) if e.sample is not None else None
            lp = lps.get(next(row)) if e.sample is not None else None
            req = self.table.get(e.req_id)
            if req is None or req.state != State.RUNNING:
                continue  # aborted or retracted while the step ran
            req.num_computed = e.end
            self._release_window(req)
            if tok is None:
                continue
            req.output_ids.append(tok)
            self.stats.generation_tokens += 1
            if req.first_token_at is None:
                req.first_token_at = now
            new.setdefault(req.id, []).append(tok)
            if lp is not None:
                new_lps.setdefault(req.id, []).append(lp)
            reason = self._stop_reason(req, tok)
            if reason:
                done.append((req, reason))
        finishing = {r.id for r, _ in done}
        for rid, toks in new.items():
            handoff = None
            if self.config.role == "prefill" and rid not in finishing:
                handoff = self.transfers.offer(rid)
            self._outputs.append(StepOutput(rid, toks, False, None, handoff, new_lps.get(rid)))
        for req, reason in done:
            self._finish(req, reason)

    def _stop_reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if tok in p.stop_token_ids or (tok in self.eos and not p.ignore_eos):
            return "stop"
        if p.stop and self.decode is not None:
            text = self.decode(req.output_ids)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                req.text = text[: min(hits)]
                return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _release_window(self, req: Request) -> None:
        for c in self.components:
            if c.kind != WINDOW:
                continue
            table = req.indices[c.name]
            nums = releasable_pages(c, table, req.num_computed, self.config.page_size)
            if nums:
                self._release(req.id, {c.name: [table[n] for n in nums]})
                for n in nums:
                    table[n] = -1

    def _finish(self, req: Request, reason: str, counted: bool = True) -> None:
        """A request leaves the replica: release what its state held, end its stream."""
        self._forget.append(req.id)
        was = self.table.finish(req, reason)
        if was in (State.RUNNING, State.OFFERED):
            req.export_payload = None
            self.moves.free_device(req)
        elif was == State.RETRACTED:
            self.moves.release_backup(req)
        if not counted:  # taken over by another replica
            return
        if self.decode is not None and not req.text:
            req.text = self.decode(req.output_ids)
        self.stats.finished[reason] += 1
        self._outputs.append(StepOutput(req.id, [], True, reason))
        self.finished_requests[req.id] = req

    def _auto_resume(self) -> None:
        for req in list(self.retracted):
            if req.hold or req.retracted_at_step == self.step_count:
                continue
            if self._restore(req) == Outcome.NO_CAPACITY:
                break  # keep order: the oldest retracted request goes first

    # ---- hand-offs (see transfer.py) -----------------------------------------------------
    def export_running(self, req_id: str) -> dict | None:
        return self.transfers.offer(req_id)

    def release_handoff(self, req_id: str) -> bool:
        return self.transfers.acknowledged(req_id)

    def import_request(self, handoff: dict) -> Outcome:
        return self.transfers.import_(handoff)

    def reclaim_expired_offers(self, now: float | None = None) -> list[str]:
        return self.transfers.reclaim_expired(time.monotonic() if now is None else now)

    def step_outputs_flush(self) -> list[StepOutput]:
        out, self._outputs = self._outputs, []
        return out

    # ---- faults ----------------------------------------------------------------------------
    def reset_for_recovery(self) -> list[str]:
        """After the ranks were lost and restarted with empty pools: every request keeps its
        tokens and is rebuilt by prefill (recompute). Returns the ids affected."""
        live = self._drop_all_state()
        self.stats.recoveries += 1
        return [r.id for r in live]

    def fail_all(self, reason: str = "error") -> list[str]:
        """Finish every unfinished request (ranks gone for good); nothing stays queued."""
        self._drop_all_state()
        ids = list(self.requests)
        for rid in ids:
            self._finish(self.requests[rid], reason)
        return ids

    def _drop_all_state(self) -> list[Request]:
        """Forget every index, backup and step in flight; every live request back to waiting."""
        self._inflight, self._frees, self._forget, self._pressure = None, [], [], False
        live = self.table.rebuild_all()
        for req in live:
            req.indices, req.backup, req.num_computed, req.export_payload = {}, None, 0, None
        # in place: the state mover holds these same dicts
        self.alloc.update({n: IndexAllocator(n, a.capacity) for n, a in self.alloc.items()})
        self.host_alloc.update({n: IndexAllocator(a.name, a.capacity) for n, a in self.host_alloc.items()})
        return live

    # ---- inspection --------------------------------------------------------------------
    def describe_requests(self) -> list[dict]:
        out = []
        for req in self.requests.values():
            d = {
                "id": req.id, "state": req.state.value, "hold": req.hold,
                "prompt_tokens": len(req.prompt_ids), "output_tokens": len(req.output_ids),
                "computed_tokens": req.num_computed, "retractions": req.retractions,
                "transferred_bytes": dict(req.transferred_bytes),
                "indices": {k: list(v) for k, v in req.indices.items()},
            }
            if req.backup is not None:
                d["backup"] = req.backup.manifest.to_dict()
            out.append(d)
        return out

    def check_invariants(self) -> None:
        """free + used == capacity for every pool, and every owner is a live request in the
        state that may own it (running or offered: device indices; retracted: host rows)."""
        for a in list(self.alloc.values()) + list(self.host_alloc.values()):
            a.check()
        deferred = {o for _, o, _ in self._frees}
        for c in self.components:
            for owner in self.alloc[c.name].owners() - deferred:
                req = self.table.get(owner)
                if req is None or req.state not in (State.RUNNING, State.OFFERED):
                    raise AssertionError(f"{c.name}: index owned by {owner}, which is not running")
            for owner in self.host_alloc[c.name].owners():
                req = self.table.get(owner)
                if req is None or req.state != State.RETRACTED:
                    raise AssertionError(f"host {c.name}: rows owned by {owner}, which is not retracted")
        kept = sum(1 for r in self.retracted if r.backup is not None and r.backup.location.place == Place.RANK_MEMORY)
        for rank, n in self.executor.num_backups().items():
            if n != kept:
                raise AssertionError(f"rank {rank} holds {n} cpu backups, expected {kept}")

    def is_idle_clean(self) -> bool:
        return all(a.num_used == 0 for a in list(self.alloc.values()) + list(self.host_alloc.values()))

    def pool_usage(self) -> dict[str, dict[str, int]]:
        return {c.name: {"capacity": self.alloc[c.name].capacity, "used": self.alloc[c.name].num_used,
                         "host_capacity": self.host_alloc[c.name].capacity,
                         "host_used": self.host_alloc[c.name].num_used} for c in self.components}

    def counts(self) -> dict[str, int]:
        return self.table.counts()
