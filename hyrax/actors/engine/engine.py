"""The engine of one role replica: orchestration of the request table, the scheduler, the
allocators, retraction and hand-offs.

One step is `schedule() -> StepPlan`, `executor.submit(plan)`, `commit(plan, tokens)`, run as a
pipeline of depth 1 (synchronous) or 2 (overlap: step N+1 is submitted before step N is
committed). Commit reads the plan, never live request fields. Every release of device
indices, whatever the reason a request leaves, goes through one point (`InFlight.release`),
which defers it past the step in flight. Ray-free: the same engine drives an in-process rank
(`hyrax generate`, unit tests) or TP rank actors (the Ray coordinator).
"""
from __future__ import annotations

import dataclasses
import logging
import itertools
import random
import time
import uuid

from hyrax.actors.engine.admission import check_request, claim
from hyrax.actors.engine.allocator import IndexAllocator
from hyrax.actors.engine.batch_cap import BatchCap
from hyrax.actors.engine.caching import PrefixCaching
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.executor import Executor, StepError, StepOutOfMemory, StepResult
from hyrax.actors.engine.grammar_gate import GrammarGate
from hyrax.actors.engine.indices import IndexTable
from hyrax.actors.engine.inflight import InFlight
from hyrax.actors.engine.inspection import all_free, check_invariants, describe_requests, pool_usage
from hyrax.actors.engine.lane import DecodeLane
from hyrax.actors.engine.prefix_nodes import CACHE_OWNER
from hyrax.actors.engine.lifecycle import Outcome, RequestTable
from hyrax.actors.engine.moves import make_moves
from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.recovery import Recovery
from hyrax.actors.engine.pools import PoolSizes
from hyrax.actors.engine.request import Request, SamplingParams, State
from hyrax.actors.engine.retractions import Retractions
from hyrax.actors.engine.results import Results, StepOutput, StopRule
from hyrax.actors.engine.scheduler import NeedRoom, Scheduled, Scheduler
from hyrax.actors.engine.selection import pick_victims
from hyrax.actors.engine.stats import EngineStats
from hyrax.actors.engine.transfer import Transfers
from hyrax.actors.engine.view import build_view
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.state import ComponentSpec

log = logging.getLogger("hyrax.engine")

__all__ = ["Engine", "StepOutput"]


class Engine:
    def __init__(self, components: tuple[ComponentSpec, ...], sizes: PoolSizes, host_rows: dict[str, int],
                 executor: Executor, config: EngineConfig, vocab_size: int, max_model_len: int,
                 eos_token_ids: tuple[int, ...] = (), decode=None):
        if config.max_batch_tokens is None:
            raise ValueError("the step budget is left to the device: pass config.for_device(<its type>)")
        self.components = components
        self.config = config
        self.executor = executor
        self.vocab_size = vocab_size
        self.max_model_len = min(max_model_len, config.max_model_len or max_model_len)
        self.eos = set(eos_token_ids)
        self.decode = decode  # token ids -> text, for stop strings and finished requests' text
        self.sizes = sizes
        self.alloc = {c.name: IndexAllocator(c.name, sizes.units[c.name]) for c in components}
        self.host_alloc = {c.name: IndexAllocator(f"host_{c.name}", max(host_rows.get(c.name, 0), 1))
                           for c in components}
        self.stats = EngineStats()
        self.table = RequestTable()
        # how big a step may be: the config's numbers, lowered after an out-of-memory step
        self.cap = BatchCap(config, self.stats.batch_cap)
        self.scheduler = Scheduler(components, config)
        # last plan's steady decodes, planned on without a view next step (a prefill replica never decodes)
        self.lane = DecodeLane(config.page_size, config.mamba_track_interval if config.caches_prefixes else None,
                               enabled=config.role != "prefill")
        self._committed_step: int | None = None
        self.reserve_ratio = 0.0  # adaptive admission: raised by memory pressure, decays per step
        # the pipeline: the step the ranks are running (depth 2 only) and the frees waiting for it
        self.inflight = InFlight(self.alloc)
        # the prefix cache adds its checkpoint pools to self.alloc (caching.py)
        self.caching = PrefixCaching(components, config, sizes, self.alloc, self.inflight.release,
                                     self.stats.prefix)
        self.moves = make_moves(components, config, executor, self.alloc, self.host_alloc, self.stats,
                                release=self.inflight.release, cache=self.caching)
        self.retractions = Retractions(self.table, self.moves)
        self.results = Results(self.table, self.stats, StopRule(self.eos, self.max_model_len, decode), components,
                               config.page_size, self.inflight.release, self.caching.owned)
        self.transfers = Transfers(self.table, self.moves, self.stats, config.offer_lease_s, settle=self._settle,
                                   leave=self._leave, load=self.retractions.restore)
        self.step_count = 0
        self.forced_interval = config.forced_retraction_interval
        self._outputs: list[StepOutput] = []
        self._ids = itertools.count()
        self.finished_requests: dict[str, Request] = {}
        self._forget: list[str] = []  # requests whose last token the ranks may forget
        self._pressure = False
        self.grammars = GrammarGate()  # which grammars rank 0 has compiled: the others' requests wait
        # a prefill replica's requests whose hand-off it took back (`take_back`): it decodes them to
        # their end, in whatever state they are (running, retracted, or waiting to be rebuilt)
        self.decodes_here: frozenset[str] = frozenset()
        self.recovery = Recovery(self.table, self.inflight, executor, self.stats, self.alloc, self.host_alloc,
                                 finish=self._finish, reset=self._reset_pipeline, free_device=self.moves.free_device,
                                 cap=self.cap, revoke_hits=self.caching.revoke,
                                 release_backup=self.moves.release_backup, leave=self._leave)

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
        self._check(prompt_ids, params)
        rid = request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:6]}"
        if rid in self.table:
            raise HyraxInputError(f"request id {rid!r} is already in use")
        seed = params.seed if params.seed is not None else random.getrandbits(62)
        self.table.admit(Request(rid, list(prompt_ids), params, seed))
        self.grammars.want(params.grammar)
        self.stats.prompt_tokens += len(prompt_ids)
        return rid

    def _check(self, token_ids: list[int], params: SamplingParams) -> None:
        """Raises HyraxInputError unless this replica can run a request with these tokens."""
        check_request(token_ids, params, self.vocab_size, self.max_model_len, self.components, self.sizes,
                      self.config.page_size, self.config.prefill_chunk)
        if why := self.grammars.why_not(params.grammar):
            raise HyraxInputError(f"the grammar does not compile for this model's vocabulary: {why}")

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
        return bool(self.running or self.waiting or self.inflight.step is not None
                    or any(not r.hold for r in self.retracted))

    # ---- retraction API (admin; retractions.py) ------------------------------------------
    def retract(self, req_ids: list[str], mode: str | None = None, hold: bool = False,
                trigger: str = "admin") -> dict[str, Outcome]:
        """Retract running requests by id. Returns id -> the backup mode used, or a refusal."""
        self.sync()  # a retracted request has no step in flight
        return self.retractions.retract_ids(req_ids, mode, hold, trigger, self.step_count)

    def resume(self, req_ids: list[str]) -> dict[str, Outcome]:
        """Release held requests; they are restored now, or as soon as memory allows (QUEUED)."""
        self.sync()
        return self.retractions.resume_ids(req_ids)

    def set_forced_retraction(self, interval: int) -> None:
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 0:
            raise HyraxInputError("interval must be an integer >= 0 (0 = off)")
        self.forced_interval = interval

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
        self.retractions.auto_resume(self.step_count)
        if forced:
            for v in pick_victims(self.running, 1):
                self.retractions.retract(v, "forced", None, False, self.step_count)
        plan = self._plan()
        handle = self.executor.submit(plan) if self._submits(plan) else None
        prev = self.inflight.swap((plan, handle) if handle is not None else None)
        if prev is not None:
            self._commit_step(*prev)  # step N-1, while the ranks run step N
        if not self.config.overlap:
            self.sync()
        out, self._outputs = self._outputs, []
        return out

    def _plan(self) -> StepPlan:
        """Ask the scheduler, make the room it needs (retract victims, give up on a request
        that can never grow) and ask again; then claim what the plan takes."""
        admit_new = not any(not r.hold for r in self.retracted)
        max_running = self.scheduler.config.max_running  # the batch cap's
        if admit_new:
            self.caching.attach(self.waiting[:max(max_running - len(self.running), 0)])
        else:  # a retracted request goes first: prefixes waiting requests matched must not keep its restore from room
            self._unlock_queued_hits()
        lane, lane_reqs = self.lane.take(self.inflight.plan, self._committed_step)
        # requests whose grammar rank 0 is still compiling sit this step out (grammar_gate.py)
        held = self._grammar_held if self.grammars.waiting else None
        listed = self.config.max_batch_tokens  # free units the view lists per pool: a step's tokens' pages
        while True:
            got = self.scheduler.schedule(build_view(
                self.step_count, self.running, self.waiting, self.alloc, self.inflight.plan, max_running,
                listed, admit_new, self.reserve_ratio, lane, lane_reqs, bool(self.table.offered), held,
                self.decodes_here))
            if isinstance(got, NeedRoom) and got.widen:  # room to make: every running request as a view
                lane, lane_reqs = None, ()
                continue
            if isinstance(got, NeedRoom) and got.listed:  # hits' window pages too: a longer free list
                listed = max(got.listed, 2 * listed)
                continue
            if got.short and self.caching.evict(got.short):
                # cached prefixes go before any request is retracted or kept waiting; their units
                # are free now, or once the step in flight is committed (then the next step syncs)
                if self.inflight.step is None:
                    continue
                got = dataclasses.replace(got, pressure=True)
            if isinstance(got, Scheduled):
                if got.short and not self.running and self.inflight.step is None and self._unlock_queued_hits():
                    # nothing runs to free units and eviction found no more: the rest of the cache
                    # is locked by waiting requests' hits (a hit's window takes pages of its own
                    # besides the cached ones): let go of them, evict, and admit without
                    continue
                break
            self._make_room(got)
        self._pressure = got.pressure
        self.reserve_ratio = max(0.0, self.reserve_ratio - 0.02)
        claim(got, self.table, self.alloc, self.stats)
        self.lane.keep(got.plan, got.lane, got.joiners, self.table.requests)
        plan = self.caching.prepare(got.plan, self.table)
        if self._forget and plan.num_rows:
            plan = dataclasses.replace(plan, forget=tuple(self._forget))
            self._forget = []
        if asks := self.grammars.asks():
            plan = dataclasses.replace(plan, grammars=asks)
        return plan

    def _grammar_held(self, req: Request) -> bool:
        return self.grammars.holds(req.params.grammar)

    def _submits(self, plan: StepPlan) -> bool:
        """Whether `plan` goes to the ranks: it runs requests or asks for grammars, or it is an
        empty step that only hears which grammar compiles ended, sent while requests wait for
        one and no step is in flight (whose result would say as much)."""
        if plan.num_rows or plan.grammars:
            return True
        if self.grammars.pending and self.inflight.step is None:
            self.grammars.pause_before_poll()
            return True
        return False

    def _make_room(self, need: NeedRoom) -> None:
        if (need.victims or need.hopeless) and self._unlock_queued_hits():
            return  # the cached prefixes they locked can be evicted now: ask again
        for rid in need.victims:
            self.retractions.retract(self.table.get(rid), "memory", None, False, self.step_count)
            self.reserve_ratio = 1.0
        for rid in need.hopeless:
            self._finish(self.table.get(rid), "length")

    def _unlock_queued_hits(self) -> bool:
        """Let go of the prefix-cache hits of waiting requests (each matches again when it can be
        admitted): the nodes they lock cannot be evicted for a running request. True if any was."""
        held = [r for r in self.waiting if r.cache is not None and r.cache.node is not None]
        for req in held:
            self.caching.detach(req)
            req.indices, req.num_computed = IndexTable(), 0
        return bool(held)

    def has_inflight(self) -> bool:
        return self.inflight.step is not None

    def in_flight_ids(self) -> set[str]:
        """Requests the step in flight runs."""
        return self.inflight.ids()

    def sync(self) -> None:
        """Collect and commit the step in flight; the frees that waited for it happen then."""
        prev = self.inflight.swap(None)
        if prev is not None:
            self._commit_step(*prev)

    def _settle(self, req_id: str) -> None:
        """Commit the step in flight if it runs `req_id` (its state is then its committed tokens)."""
        if req_id in self.inflight.ids():
            self.sync()

    def _commit_step(self, plan: StepPlan, handle) -> None:
        try:
            result = self.executor.collect(handle)
        except StepError as e:
            self.recovery.step_failed(plan, e)
            if isinstance(e, StepOutOfMemory):
                self.scheduler = Scheduler(self.components, self.cap.config)  # the lowered cap
            return
        self.commit(plan, result)
        self._committed_step = plan.step
        self.inflight.committed(plan.step)
        if self.cap.step_ok():
            self.scheduler = Scheduler(self.components, self.cap.config)

    def commit(self, plan: StepPlan, result: StepResult) -> None:
        """Apply a step's results using the step's own plan snapshot (results.py); a prefill
        replica offers each request that got its first token to a decode replica."""
        if result.grammars_ready or result.grammars_failed:
            self._grammars_settled(result)
        done = self.results.apply(plan, result)
        self.caching.commit(plan, result, self.table)
        self.results.release_windows(plan)
        lps, outputs, tokens = done.logprobs, self._outputs, done.tokens
        if self.config.role == "prefill":  # a request that got its first token is offered on
            finishing = {r.id for r, _ in done.stopped}
            for rid, toks in tokens.items():
                offers = rid not in finishing and rid not in self.decodes_here
                handoff = self.transfers.offer(rid) if offers else None
                outputs.append(StepOutput(rid, toks, False, None, handoff, lps.get(rid) if lps else None))
        else:  # one map, no per-request branch
            none = itertools.repeat(None)
            outputs.extend(map(StepOutput, tokens, tokens.values(), itertools.repeat(False), none, none,
                               map(lps.get, tokens) if lps else none))
        for req, reason in done.stopped:
            self._finish(req, reason)

    def _grammars_settled(self, result: StepResult) -> None:
        """Rank 0 finished compiling grammars: their requests run from the next step. One whose
        compile failed there (the gateway's check, without the vocabulary, let it through) ends
        its requests with an error instead of failing a step of every request."""
        self.grammars.done(result.grammars_ready)
        if not result.grammars_failed:
            return
        failed = dict(result.grammars_failed)
        self.grammars.fail(result.grammars_failed)
        for req in [r for r in self.table.requests.values() if r.params.grammar in failed]:
            log.warning("request %s: its grammar did not compile on rank 0: %s", req.id, failed[req.params.grammar])
            self._finish(req, "error")

    def _leave(self, req: Request, reason: str) -> None:
        """A request leaves the replica: release what its state held (device indices through
        the one free point, or its backup). Not counted as finished: another replica has it."""
        self._forget.append(req.id)
        if req.id in self.decodes_here:
            self.decodes_here -= {req.id}
        was = self.table.finish(req, reason)
        if was in (State.RUNNING, State.OFFERED):
            req.export_payload = None
            self.moves.free_device(req)
        elif was == State.RETRACTED:
            self.moves.release_backup(req)
        else:  # waiting: a prefix-cache hit it matched, nothing of its own
            self.caching.detach(req)
            req.indices = IndexTable()

    def _finish(self, req: Request, reason: str) -> None:
        """A request ends here: it leaves, and its stream ends with `reason`, also when releasing
        its state raised (a rank that died before it discarded the request's backup)."""
        try:
            self._leave(req, reason)
        finally:
            scan = req.stop_scan  # a stop string ended it: its text is what came before (maybe nothing)
            if self.decode is not None and not (scan is not None and scan.stopped):
                req.text = self.decode(req.output_ids)
            self.stats.finished[reason] += 1
            self._outputs.append(StepOutput(req.id, [], True, reason))
            self.finished_requests[req.id] = req

    # ---- hand-offs (see transfer.py) -----------------------------------------------------
    def export_running(self, req_id: str) -> dict | None:
        return self.transfers.offer(req_id)

    def release_handoff(self, req_id: str) -> bool:
        return self.transfers.acknowledged(req_id)

    def import_request(self, handoff: dict, own: bool = False) -> Outcome:
        """Take over a request another replica offered (transfer.py). A prefill replica takes
        none: it never decodes, so a request it took would hold its state and never move. Nor does
        a replica whose pools (or context) could never hold the request's tokens: it would wait
        retracted for room that never comes, and stop every admission here meanwhile.
        `own`: the hand-off is this replica's own, come back (no other replica took it) after its
        offer was let go here (its ranks were lost since): it takes it over as any import (rebuilt
        from its tokens where its exported state went with the ranks), and a prefill replica then
        decodes it to its end, as it does an offer it takes back. A hand-off without state (the
        replica decoding it was lost, and no replica that decodes is in service) is rebuilt here
        from its tokens and decoded to its end the same way, rather than ended with an error."""
        r = handoff["request"]
        if self.config.role == "prefill" and not own and handoff.get("manifest") is not None:
            raise HyraxInputError(f"request {r['id']!r} offered to a prefill replica, which does not decode")
        try:  # its tokens so far as a prompt: a request this replica could never run would wait for good
            self._check(list(r["prompt_ids"]) + list(r["output_ids"]), r["params"])
        except HyraxInputError as e:
            raise HyraxInputError(f"request {r['id']!r} cannot continue on this replica: {e}") from None
        # a prefill replica decodes it once it is in the table, also where loading its state lost a
        # rank (the loop's recovery then rebuilds it here, and it must run on, not wait for good)
        decodes = r["id"] not in self.table
        try:
            result = self.transfers.import_(handoff)
        finally:
            if decodes and r["id"] in self.table:
                self._decode_here(r["id"])
        self.grammars.want(r["params"].grammar)  # compiled here before its next step (grammar_gate.py)
        return result

    def take_back(self, handoff: dict) -> Outcome | None:
        """Run on a request this replica offered, which no other replica took (transfer.py);
        None: `handoff` is not that offer (import it). A prefill replica that takes back its
        hand-off (no decode replica could take it) decodes the request to its end itself, as a
        colocated replica would, rather than offer it again after every token."""
        taken = self.transfers.take_back(handoff)
        if taken is not None:
            self._decode_here(handoff["request"]["id"])
        return taken

    def _decode_here(self, req_id: str) -> None:
        """A request that came back to this replica runs to its end here: on a prefill replica,
        past its first token (`decodes_here`); elsewhere it would anyway."""
        if self.config.role == "prefill":
            self.decodes_here |= {req_id}

    def reclaim_expired_offers(self, now: float | None = None) -> list[str]:
        return self.transfers.reclaim_expired(time.monotonic() if now is None else now)

    def offer_carried_by(self, req_id: str, gateway: str) -> None:
        self.transfers.carried(req_id, gateway)

    def reclaim_offers_carried_by(self, gateway: str) -> list[str]:
        return self.transfers.reclaim_carried(gateway)

    def step_outputs_flush(self) -> list[StepOutput]:
        out, self._outputs = self._outputs, []
        return out

    # ---- faults (recovery.py) -----------------------------------------------------------
    def reset_for_recovery(self) -> list[str]:
        return self.recovery.reset_for_recovery()

    def fail_all(self, reason: str = "error", ranks_alive: bool = False) -> list[str]:
        return self.recovery.fail_all(reason, ranks_alive)

    def _reset_pipeline(self) -> None:
        self._forget, self._pressure = [], False
        self.lane.clear()
        self.caching.reset(self.table.requests.values())
        self.grammars.reset(self.table.requests.values())  # new ranks have compiled nothing

    # ---- inspection (inspection.py) ------------------------------------------------------
    def describe_requests(self) -> list[dict]:
        return describe_requests(self.requests.values())

    def check_invariants(self) -> None:
        """free + used == capacity for every pool, every owner is a live request in the state
        that may own it (running or offered: device indices; retracted: host rows) or the prefix
        cache, and the cache's tree agrees with the allocators."""
        check_invariants(self.components, self.alloc, self.host_alloc, self.table, self.inflight.deferred_owners(),
                         self.executor.num_backups())
        self.caching.check(self.inflight.deferred_units(CACHE_OWNER))

    def is_idle_clean(self) -> bool:
        """Nothing owned by a request (the prefix cache may hold units; nothing references them)."""
        return all_free(self.alloc, self.host_alloc) and self.caching.tree.root.ref == 0

    def pool_usage(self) -> dict[str, dict[str, int]]:
        return pool_usage(self.components, self.alloc, self.host_alloc, self.caching.cached())

    # ---- the prefix cache (caching.py) -------------------------------------------------
    def flush_cache(self) -> dict[str, int]:
        """Evict every cached prefix no request uses; units freed per pool."""
        return self.caching.flush()

    def cached_prefix(self, token_ids: list[int]) -> int:
        """Tokens of a prompt a cache hit would cover now (0 with the cache off)."""
        return self.caching.peek(token_ids)

    def counts(self) -> dict[str, int]:
        return self.table.counts()
