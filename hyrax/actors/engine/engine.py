"""The engine of one role replica: request table, scheduler, allocators, retraction.

Stage contracts: `schedule() -> StepPlan`, `executor.execute(plan) -> tokens`,
`commit(plan, tokens)`. Commit reads the plan, not live request fields, and all frees
happen in one place (`_finish`). Ray-free: the same engine drives an in-process rank
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
from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.pools import PoolSizes
from hyrax.actors.engine.request import Request, SamplingParams, State
from hyrax.actors.engine.retraction import Retractor, pick_victims
from hyrax.actors.engine.scheduler import Scheduler
from hyrax.actors.engine.stats import EngineStats
from hyrax.actors.engine.statecopy import pages_needed, releasable_pages
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.state import ComponentSpec


@dataclass
class StepOutput:
    req_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    handoff: dict | None = None  # set when the request was exported to another replica
    logprobs: list[dict] | None = None  # one per new token, when the request asked for them


class Engine:
    def __init__(self, components: tuple[ComponentSpec, ...], sizes: PoolSizes, host_rows: dict[str, int],
                 executor, config: EngineConfig, vocab_size: int, max_model_len: int,
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
        self.scheduler = Scheduler(components, config, self.alloc)
        self.retractor = Retractor(components, config, executor, self.alloc, self.host_alloc, self.stats)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []
        self.running: list[Request] = []
        self.retracted: list[Request] = []
        self.step_count = 0
        self.forced_interval = config.forced_retraction_interval
        self._outputs: list[StepOutput] = []
        self._ids = itertools.count()
        self.finished_requests: dict[str, Request] = {}
        self.handoffs: dict[str, Request] = {}
        # overlap scheduling: the step the ranks are running, frees waiting for it, and
        # requests whose last token the ranks may forget
        self._inflight: tuple[StepPlan, object] | None = None
        self._deferred: list[tuple[str, dict[str, list[int]]]] = []
        self._forget: list[str] = []
        self._pressure = False

    # ---- request API -------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        """Validate and queue a request. Bad input raises HyraxInputError and changes nothing."""
        params.validate()
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
                need = pages_needed(c, len(prompt_ids) + 1, ps) if c.kind == "token" else \
                    pages_needed(c, min(len(prompt_ids) + 1, c.window + self.config.prefill_chunk), ps)
                if need > self.sizes.units[c.name]:
                    raise HyraxInputError(
                        f"prompt of {len(prompt_ids)} tokens can never fit the {c.name} pool "
                        f"({self.sizes.units[c.name] * ps} tokens)"
                    )
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        if rid in self.requests:
            raise HyraxInputError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        req = Request(rid, list(prompt_ids), params, seed)
        self.requests[rid] = req
        self.waiting.append(req)
        self.stats.prompt_tokens += len(prompt_ids)
        return rid

    def abort(self, req_id: str) -> bool:
        req = self.requests.get(req_id)
        if req is None:
            return False
        self._finish(req, "abort")
        return True

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def has_work(self) -> bool:
        """Something a step can advance: running or waiting requests, a retracted one that
        may resume, or a step in flight. Held and handed-off requests wait for a call."""
        return bool(self.running or self.waiting or self._inflight is not None
                    or any(not r.hold for r in self.retracted))

    # ---- retraction API (admin) --------------------------------------------------------
    def retract(self, req_ids: list[str], mode: str | None = None, hold: bool = False,
                trigger: str = "admin") -> dict[str, str]:
        """Retract running requests by id. Returns id -> mode used, or an error string."""
        if mode is not None and mode not in ("cpu_tensor", "host_pool", "recompute"):
            raise HyraxInputError("mode must be cpu_tensor, host_pool or recompute")
        self.sync()  # a retracted request has no step in flight
        out = {}
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None:
                out[rid] = "error: unknown request"
            elif req.state != State.RUNNING:
                out[rid] = f"error: request is {req.state.value}, not running"
            else:
                out[rid] = self._retract(req, trigger, mode, hold)
        return out

    def resume(self, req_ids: list[str]) -> dict[str, str]:
        """Release held requests; they are restored as soon as memory allows."""
        out = {}
        for rid in req_ids:
            req = self.requests.get(rid)
            if req is None or req.state != State.RETRACTED:
                out[rid] = "error: not retracted"
                continue
            req.hold = False
            result = self._restore(req)
            out[rid] = "queued" if result == "no_capacity" else result
        return out

    def set_forced_retraction(self, interval: int) -> None:
        if interval < 0:
            raise HyraxInputError("interval must be >= 0 (0 = off)")
        self.forced_interval = interval

    def _retract(self, req: Request, trigger: str, mode: str | None, hold: bool) -> str:
        used = self.retractor.retract(req, trigger, mode, hold)
        self.running.remove(req)
        self.retracted.append(req)
        req._retracted_at = self.step_count
        return used

    def _restore(self, req: Request) -> str:
        result = self.retractor.restore(req)
        if result == "no_capacity":
            return result
        self.retracted.remove(req)
        if req.state == State.RUNNING:
            self.running.append(req)
        else:  # rebuilt by prefill: first in line
            self.waiting.insert(0, req)
        return result

    # ---- the loop ----------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        self.step_count += 1
        self.stats.steps += 1
        self._auto_resume()
        if self.forced_interval and self.step_count % self.forced_interval == 0:
            for v in pick_victims(self.running, 1):
                self._retract(v, "forced", None, False)
        plan, admitted = self.scheduler.schedule(
            self.step_count, self.running, self.waiting, self._make_room, self._no_room,
            admit_new=not any(not r.hold for r in self.retracted),
        )
        self._admitted(admitted)
        plan = self._with_forget(plan)
        if plan.entries:
            tokens = self.executor.execute(plan)
            self.commit(plan, tokens)
        out, self._outputs = self._outputs, []
        return out

    def _admitted(self, admitted: list[Request]) -> None:
        now = time.monotonic()
        for r in admitted:
            self.running.append(r)
            if r.first_scheduled_at is None:
                r.first_scheduled_at = now
                self.stats.queue_seconds.append(now - r.arrival)

    def _with_forget(self, plan: StepPlan) -> StepPlan:
        if self._forget and plan.entries:
            plan = dataclasses.replace(plan, forget=tuple(self._forget))
            self._forget = []
        return plan

    # ---- overlap scheduling ------------------------------------------------------------
    def has_inflight(self) -> bool:
        return self._inflight is not None

    def sync(self) -> None:
        """Collect and commit the step in flight, then run the frees that waited for it."""
        if self._inflight is None:
            return
        plan, handle = self._inflight
        self._inflight = None
        tokens = self.executor.collect(handle)
        self.commit(plan, tokens)
        for owner, indices in self._deferred:
            for name, idx in indices.items():
                live = [i for i in idx if i >= 0]
                if live:
                    self.alloc[name].free(owner, live)
        self._deferred = []

    def step_overlap(self) -> list[StepOutput]:
        """Plan and submit step N+1, then commit step N. Retractions, restores and memory
        pressure need a request with no step in flight: those steps sync first."""
        self.step_count += 1
        self.stats.steps += 1
        forced = bool(self.forced_interval) and self.step_count % self.forced_interval == 0
        resumable = any(not r.hold for r in self.retracted)
        if forced or resumable or self._pressure:
            self.sync()
            self._pressure = False
        self._auto_resume()
        if forced:
            for v in pick_victims(self.running, 1):
                self._retract(v, "forced", None, False)
        prev = self._inflight
        if prev is not None:
            self.scheduler.ahead = {
                e.req_id: (e.end, len(self.requests[e.req_id].output_ids) + (e.sample is not None))
                for e in prev[0].entries if e.req_id in self.requests
            }
        try:
            plan, admitted = self.scheduler.schedule(
                self.step_count, self.running, self.waiting, self._make_room, self._no_room,
                admit_new=not any(not r.hold for r in self.retracted),
            )
        finally:
            self.scheduler.ahead = {}
        self._admitted(admitted)
        plan = self._with_forget(plan)
        handle = self.executor.submit(plan) if plan.entries else None
        self.sync()  # commits step N (prev), if any, while the ranks run N+1
        if handle is not None:
            self._inflight = (plan, handle)
        out, self._outputs = self._outputs, []
        return out

    def _inflight_ids(self) -> set[str]:
        return {e.req_id for e in self._inflight[0].entries} if self._inflight else set()

    def _free_device(self, req: Request) -> None:
        """Free now, or — if the step in flight still writes these indices — after it."""
        if req.id in self._inflight_ids():
            self._deferred.append((req.id, {k: list(v) for k, v in req.indices.items()}))
            req.indices = {}
        else:
            self.retractor.free_device(req)

    def commit(self, plan: StepPlan, tokens) -> None:
        """Apply a step's results using the step's own plan snapshot. `tokens` is the list of
        sampled ids, or (ids, {sampling row: logprobs}) when some request asked for logprobs."""
        lps: dict[int, dict] = {}
        if isinstance(tokens, tuple):
            tokens, lps = tokens
        row = iter(range(len(tokens)))
        it = iter(tokens)
        new: dict[str, list[int]] = {}
        new_lps: dict[str, list[dict]] = {}
        done: list[tuple[Request, str]] = []
        now = time.monotonic()
        for e in plan.entries:
            tok = next(it) if e.sample is not None else None
            lp = lps.get(next(row)) if e.sample is not None else None
            req = self.requests.get(e.req_id)
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
                handoff = self.export_running(rid)
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
            if c.kind != "window":
                continue
            table = req.indices[c.name]
            nums = releasable_pages(c, table, req.num_computed, self.config.page_size)
            if nums:
                self.alloc[c.name].free(req.id, [table[n] for n in nums])
                for n in nums:
                    table[n] = -1

    def _finish(self, req: Request, reason: str) -> None:
        """The one place a request's indices and backups are released."""
        self._forget.append(req.id)
        if req.state == State.RUNNING:
            self._free_device(req)
            self.running.remove(req)
        elif req.state == State.RETRACTED:
            self.retractor.release_backup(req)
            self.retracted.remove(req)
        elif req.state == State.WAITING:
            self.waiting.remove(req)
        elif req.state == State.HANDOFF:
            self._free_device(req)
            del self.handoffs[req.id]
        req.state = State.FINISHED
        req.finish_reason = reason
        req.finished_at = time.monotonic()
        if self.decode is not None and not req.text:
            req.text = self.decode(req.output_ids)
        self.stats.finished[reason] += 1
        del self.requests[req.id]
        self._outputs.append(StepOutput(req.id, [], True, reason))
        self.finished_requests[req.id] = req

    def _auto_resume(self) -> None:
        for req in list(self.retracted):
            if req.hold or getattr(req, "_retracted_at", -1) == self.step_count:
                continue
            if self._restore(req) == "no_capacity":
                break  # keep order: the oldest retracted request goes first

    def _make_room(self, needy: Request, need: dict[str, int], planned: set[str]) -> bool:
        """Memory pressure: retract victims until `need` fits. False if it cannot."""
        while True:
            if all(self.alloc[k].can_allocate(n) for k, n in need.items()):
                return True
            victims = pick_victims(self.running, 1, exclude=planned | {needy.id} | self._inflight_ids())
            if not victims:
                self._pressure = self._inflight is not None  # retry after the step in flight
                return False
            self._retract(victims[0], "memory", None, False)
            self.scheduler.reserve_ratio = 1.0

    def _no_room(self, req: Request) -> None:
        self._finish(req, "length")

    # ---- transfer: PD hand-off and migration ------------------------------------------
    def export_running(self, req_id: str) -> dict:
        """Export a running request's state for another replica. Its indices stay allocated
        (state HANDOFF) until `release_handoff` — after the importer acknowledged."""
        self.sync()  # the exported state is exactly the committed tokens
        req = self.requests.get(req_id)
        if req is None or req.state != State.RUNNING:
            raise HyraxInputError(f"request {req_id!r} is not running here")
        t0 = time.perf_counter()
        rows = self.retractor._rows(req.indices, req.num_computed)
        sums, payload = self.executor.export(req_id, rows)
        manifest = self.retractor.make_manifest(req, rows, sums, "transfer")
        self.running.remove(req)
        req.state = State.HANDOFF
        # the exported shards are objects this replica owns: hold their refs until the importer
        # acknowledged (release_handoff), so they cannot be freed while it is still fetching them
        req.export_payload = payload
        self.handoffs[req_id] = req
        self.stats.transfer_seconds.append(time.perf_counter() - t0)
        return {
            "request": {"id": req.id, "prompt_ids": list(req.prompt_ids), "output_ids": list(req.output_ids),
                        "params": req.params, "seed": req.seed, "retractions": req.retractions,
                        "arrival_wall": time.time() - (time.monotonic() - req.arrival)},
            "manifest": manifest,
            "payload": payload,
        }

    def release_handoff(self, req_id: str) -> bool:
        """The importer has the request: free its indices here. Not counted as finished."""
        req = self.handoffs.pop(req_id, None)
        if req is None:
            return False
        req.export_payload = None
        self._forget.append(req_id)
        self._free_device(req)
        req.state = State.FINISHED
        req.finish_reason = "transferred"
        del self.requests[req_id]
        self.stats.transfers_out += 1
        return True

    def import_request(self, handoff: dict) -> str:
        """Take over a request exported by another replica: allocate new indices, import and
        verify every component on every rank. Result: 'verified', a fallback ('fallback',
        'checksum_mismatch': rebuilt by prefill here), or 'no_capacity' (queued, imported
        when memory allows)."""
        from hyrax.actors.engine.retraction import Backup

        r = handoff["request"]
        if r["id"] in self.requests:
            raise HyraxInputError(f"request id {r['id']!r} is already in use")
        params = r["params"]
        req = Request(r["id"], list(r["prompt_ids"]), params, r["seed"], output_ids=list(r["output_ids"]))
        req.retractions = r.get("retractions", 0)
        req.state = State.RETRACTED
        req.backup = Backup(handoff["manifest"], None, handoff["payload"])
        self.requests[req.id] = req
        self.retracted.append(req)
        req._retracted_at = -1
        t0 = time.perf_counter()
        result = self._restore(req)
        self.stats.transfer_seconds.append(time.perf_counter() - t0)
        self.stats.transfers_in[result] += 1
        return result

    def step_outputs_flush(self) -> list[StepOutput]:
        out, self._outputs = self._outputs, []
        return out

    def reset_for_recovery(self) -> list[str]:
        """After the ranks were lost and restarted with empty pools: every request keeps its
        tokens and is rebuilt by prefill (recompute). Returns the ids affected."""
        self._inflight, self._deferred, self._forget, self._pressure = None, [], [], False
        live = sorted(self.running + self.retracted + list(self.handoffs.values()), key=lambda r: r.arrival)
        self.handoffs = {}
        for req in live:
            req.indices, req.backup, req.num_computed = {}, None, 0
            req.state, req.hold = State.WAITING, False
        self.waiting = live + self.waiting
        self.running, self.retracted = [], []
        self.alloc.update({n: IndexAllocator(n, a.capacity) for n, a in self.alloc.items()})
        self.host_alloc.update({n: IndexAllocator(a.name, a.capacity) for n, a in self.host_alloc.items()})
        self.stats.recoveries += 1
        return [r.id for r in live]

    def fail_all(self, reason: str = "error") -> list[str]:
        """Finish every unfinished request (ranks gone for good); nothing stays queued."""
        self._inflight, self._deferred, self._pressure = None, [], False
        for req in list(self.handoffs.values()):
            req.state = State.RUNNING
            self.running.append(req)
        self.handoffs = {}
        ids = list(self.requests)
        for rid in ids:
            req = self.requests[rid]
            req.indices, req.backup = {}, None
            if req.state == State.RUNNING:
                self.running.remove(req)
            elif req.state == State.RETRACTED:
                self.retracted.remove(req)
            else:
                self.waiting.remove(req)
            req.state = State.WAITING
            self.waiting.append(req)
            self._finish(req, reason)
        self.alloc.update({n: IndexAllocator(n, a.capacity) for n, a in self.alloc.items()})
        self.host_alloc.update({n: IndexAllocator(a.name, a.capacity) for n, a in self.host_alloc.items()})
        return ids

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

    # ---- inspection --------------------------------------------------------------------
    def check_invariants(self) -> None:
        """free + used == capacity for every pool, and every owner is a live request in the
        state that may own it (running: device indices; retracted: host rows)."""
        for a in list(self.alloc.values()) + list(self.host_alloc.values()):
            a.check()
        for c in self.components:
            deferred = {o for o, _ in self._deferred}
            for owner in self.alloc[c.name].owners() - deferred:
                req = self.requests.get(owner)
                if req is None or req.state not in (State.RUNNING, State.HANDOFF):
                    raise AssertionError(f"{c.name}: index owned by {owner}, which is not running")
            for owner in self.host_alloc[c.name].owners():
                req = self.requests.get(owner)
                if req is None or req.state != State.RETRACTED:
                    raise AssertionError(f"host {c.name}: rows owned by {owner}, which is not retracted")
        kept = sum(1 for r in self.retracted if r.backup is not None and r.backup.host_rows is None)
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
        return {"running": len(self.running), "waiting": len(self.waiting), "retracted": len(self.retracted),
                "handoff": len(self.handoffs)}
