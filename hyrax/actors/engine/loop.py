"""EngineLoop: runs an Engine's step loop in a thread and streams tokens to asyncio clients,
one batch per step per consumer (step_feed.py).

The Ray RoleCoordinator wraps one; the gateway's in-process client (tests, single-process
use) uses one directly. Ray-free.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import deque
from typing import AsyncIterator, Callable, TypeVar

from hyrax.actors.engine.commands import (Abort, CachedPrefix, Command, FlushCache, ListRequests, Load, MigrateOut,
                                          Pools, Resume, Retract, SetForcedRetraction, Stats)
from hyrax.actors.engine.early_aborts import EarlyAborts
from hyrax.actors.engine.engine import Engine
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.executor import RankFailure
from hyrax.actors.engine.request import SamplingParams, State
from hyrax.actors.engine.selection import Selection, pick_victims
from hyrax.actors.engine.step_feed import Fanout, Sink, error_item, follow, is_last, refusal_item
from hyrax.actors.model.errors import HyraxInputError

log = logging.getLogger("hyrax.engine")
T = TypeVar("T")


SHUTTING_DOWN = "the replica is shutting down"
GAVE_UP = "the replica failed and could not recover; it stops serving"
# what a request ended by its replica's failure with no reason of its own is told (a step that
# raised on live ranks, a step out of memory that no smaller step can run): the cause is in the log
FAILED = "the replica failed while running this request"


def _same_replica(a, b) -> bool:
    """Whether two hand-off sources name the same replica: the same loop in process, handles of
    the same actor over Ray (a handle that crossed Ray is another object for the same actor)."""
    if a is None or b is None:
        return False
    actor = getattr(a, "_actor_id", None)
    return a is b or (actor is not None and actor == getattr(b, "_actor_id", None))


def _ack_in_process(source, request_id: str) -> None:
    """Queued for the source loop's next turn: the importer's loop thread holds its own lock
    here, and two loops importing from each other would each wait for the other's lock."""
    source.release_soon(request_id)


class TurnLock:
    """The loop's re-entrant lock, with turns: the loop thread holds it for a whole step and
    takes it again at once, and a plain lock does not hand itself to a thread already waiting
    (admin calls, stream opens and aborts starved for seconds under load). Callers that wait
    are counted; between steps the loop lets them in first."""

    def __init__(self):
        self._lock = threading.RLock()
        self._waiting = 0
        self._count = threading.Lock()

    def __enter__(self):
        with self._count:
            self._waiting += 1
        try:
            self._lock.acquire()
        finally:
            with self._count:
                self._waiting -= 1
        return self

    def __exit__(self, *exc):
        self._lock.release()

    def let_waiters_in(self, limit_s: float = 0.002) -> None:
        """Called by the loop between steps (not holding the lock): wait, at most `limit_s` (2 ms:
        a step is not delayed more, and 50 ms cost a quarter of the c=16 throughput),
        until every thread that was waiting for the lock has had it."""
        deadline = time.monotonic() + limit_s
        while self._waiting and time.monotonic() < deadline:
            time.sleep(0.0002)


# The pool invariants are checked once the replica has been idle this long, not as soon as it
# becomes idle: the check walks every pool (O(capacity); 4-11 ms with the bench's 64k-token KV
# pool, ~20 ms in a Ray actor whose event loop competes for the GIL) and holds the lock, so a
# request arriving just after the last one ended - every request of a closed-loop client at
# concurrency 1 - waited for it before its prefill (measured: TTFT of an 8-token prompt ~35 ms
# instead of ~14).
IDLE_CHECK_AFTER_S = 0.2

# A replica with nothing to run (idle, or holding only requests an operator holds or another replica
# is taking over) runs no steps, so nothing else would find a rank that died (or hangs) meanwhile:
# the loop asks its ranks whether they are alive this often then (a plain call each, ~1 ms; parked
# ranks answer it), and a rank that fails to answer is recovered like a failed step, before a
# request or a resume needs it and while /health can still say so.
PROBE_IDLE_EVERY_S = 2.0


class EngineLoop:
    """`source`: what a hand-off names as its origin, for the importer's acknowledgement
    (this loop in-process; the coordinator's actor handle over Ray); `ack(source, id)`
    delivers one. `stuck_after_s`: a replica with work queued, nothing running and no
    progress for this long reports itself stuck. `probe`: raises RankFailure when a rank is
    dead or hung; called every PROBE_IDLE_EVERY_S while the replica has nothing to run (needs
    `on_rank_failure`). `rest`: called between steps whenever the engine has nothing to run
    (the Ray executor parks its ranks, step_bell.py); may raise RankFailure too."""

    def __init__(self, engine: Engine, name: str = "engine", on_rank_failure: Callable[[Exception], None] | None = None,
                 source=None, ack: Callable[[object, str], None] = _ack_in_process, stuck_after_s: float = 30.0,
                 probe: Callable[[], None] | None = None, rest: Callable[[], None] | None = None):
        if (probe is not None or rest is not None) and on_rank_failure is None:
            raise ValueError("a loop that probes or rests its ranks needs on_rank_failure")
        self.engine = engine
        self.on_rank_failure = on_rank_failure
        self.probe = probe
        self.rest = rest
        self.probe_every_s = PROBE_IDLE_EVERY_S
        self._probed_at = time.monotonic()
        self.source = self if source is None else source
        self.ack = ack
        self.stuck_after_s = stuck_after_s
        self._blocked_since: float | None = None
        self.invariant_error: str | None = None
        self.idle_check_after_s = IDLE_CHECK_AFTER_S
        self._idle_since: float | None = None  # when the replica last became idle (None: busy)
        self._quiet_since: float | None = None  # since when it has had nothing to run (None: it has)
        self._checked_idle = False  # the pools were checked in this idle period
        self.lock = TurnLock()
        self.wake = threading.Event()
        self.streams: dict[str, Sink] = {}  # request id -> the consumer its items go to
        # streams opened since the loop last looked, in arrival order: (request id, sink, admit);
        # an acknowledgement (release_soon) comes in the same order, with no sink
        self._opening: deque[tuple[str, Sink | None, Callable[[], dict | None]]] = deque()
        self._local: dict[asyncio.AbstractEventLoop, tuple[Sink, Fanout]] = {}  # in-process callers
        self.batches_posted = 0  # messages to consumers: one per consumer per step at most
        self.early_aborts = EarlyAborts()
        self._abort_reasons: dict[str, str] = {}  # request id -> why it was ended (aborted, given up), for its last item
        self.stopping = False
        self.refusal: str | None = None  # set once the ranks are gone for good: every new stream gets it (close)
        self.healthy = True
        self.last_error: str | None = None
        self.step_seconds: list[float] = []
        self.thread = threading.Thread(target=self._run, name=f"hyrax-{name}-loop", daemon=True)
        self.thread.start()

    # ---- the loop ----------------------------------------------------------------------
    def _run(self) -> None:
        while not self.stopping:
            with self._turn():  # a failure's outputs (requests failed or rebuilt) go out with the turn
                self._guarded(self._housekeeping)
            if not self.healthy or not self.engine.has_work():
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            with self._turn():  # and what arrived while this thread waited for the lock
                self._deliver(self._step())
            self.lock.let_waiters_in()
        with self.lock:
            self._open_streams(refuse=SHUTTING_DOWN)

    def _housekeeping(self) -> None:
        self.engine.reclaim_expired_offers()
        self._watch()

    def _step(self) -> list:
        """One engine step (under the lock); a failed one answers its requests instead."""
        t0 = time.perf_counter()
        outs = self._guarded(self.engine.step)
        if outs is None:
            return self.engine.step_outputs_flush()
        self.step_seconds.append(time.perf_counter() - t0)
        del self.step_seconds[:-1000]
        return outs

    def _guarded(self, work: Callable[[], T]) -> T | None:
        """`work()` (a step, the checks between steps, an export, an acknowledgement), or None when
        it failed: a rank that failed is recovered (`_recover`); any other error is logged and
        treated alike (an engine bug must neither wedge every stream nor end this thread)."""
        try:
            return work()
        except RankFailure as e:
            self._recover(e)
        except Exception as e:  # noqa: BLE001
            log.exception("engine loop work failed; failing the replica's requests")
            self.last_error = f"{type(e).__name__}: {e}"
            self._recover(e)
        return None

    def _on_ranks(self, work: Callable[[], T], failed: Callable[[], T]) -> T:
        """Under the lock: `work()`, a command's calls to the ranks, or `failed()` when a rank
        failed in it (died, hung, raised): the replica is recovered first, as after a failed step.
        Any other error is the command's own (bad input, a violated invariant): its caller's. A
        closed loop calls no rank (each could wait out the rank timeout): `failed()` at once."""
        if self.refusal is not None:
            return failed()
        try:
            return work()
        except RankFailure as e:
            log.warning("a rank failed during a command; recovering the replica: %s", e)
            self._recover(e)
        return failed()

    def _recover(self, err: Exception) -> None:
        """Under the lock, after `err`: `on_rank_failure` replaces the ranks (after an engine error
        too: their state is suspect) and rebuilds every request. Without that hook an engine error
        fails every request and the same ranks serve on, and a lost rank ends the replica
        (`_give_up`), as does a recovery that fails too."""
        try:
            if self.on_rank_failure is not None:
                self.on_rank_failure(err)
            elif isinstance(err, RankFailure):
                raise err
            else:
                self.engine.fail_all("error", ranks_alive=True)
        except Exception as e:  # noqa: BLE001
            self._give_up(e)

    def _give_up(self, err: Exception) -> None:
        """Under the lock: recovering from a failure failed too, and what the engine holds is not
        known any more: the loop closes (`close`); clients are told no more than GAVE_UP."""
        log.exception("recovering the replica failed; it stops serving")
        self.last_error = f"the replica could not recover: {type(err).__name__}: {err}"
        try:
            self.close(GAVE_UP)
        except Exception:  # noqa: BLE001 - the streams ended all the same
            log.exception("failing the requests of a replica that gave up failed: their units stay held")

    def close(self, message: str) -> list[str]:
        """Under the lock, when the ranks are gone for good (recovery failed, or the coordinator's
        restarts are used up): the replica reports itself unhealthy and serves nothing more, until
        it is replaced. Every request ends with the error `message` (`end_all`: each pool free
        again), every open stream ends with it (the requests already failed end as such), every
        stream opened later is refused with it at once (503: retry elsewhere; not queued for a
        step that would not come), and the loop stops: no step, probe, check or command calls the
        ranks again. The ids of the requests ended; raises if ending them raised (the streams
        end all the same)."""
        self.healthy, self.stopping, self.refusal = False, True, message
        try:
            return self.end_all(message)
        finally:
            self._deliver(self.engine.step_outputs_flush())
            for rid in list(self.streams):
                self._deliver([], (rid, error_item(message, 503)))

    def end_all(self, message: str) -> list[str]:
        """Under the lock, when the ranks are gone for good: every request ends with the error
        `message` (status 503: retry elsewhere), its state forgotten without a call to the ranks
        (every index, backup and step in flight), so each pool is free again. Their ids."""
        for rid in self.engine.requests:
            self._abort_reasons[rid] = message
        return self.engine.fail_all("error")

    def _watch(self) -> None:
        """Cheap checks between steps: stuck (work queued, nothing running, no progress) and,
        each time the replica has stayed idle for IDLE_CHECK_AFTER_S, its pool invariants."""
        e = self.engine
        blocked = bool(e.waiting or any(not r.hold for r in e.retracted)) and not e.running and not e.has_inflight()
        now = time.monotonic()
        self._blocked_since = (self._blocked_since or now) if blocked else None
        if self.rest is not None and not e.has_work():
            self.rest()  # RankFailure: recovered by the caller (_guarded)
        # nothing to run (no request, or only held and offered ones): no step would find a dead rank
        quiet = not e.has_work() and not e.has_inflight()
        self._quiet_since = (self._quiet_since or now) if quiet else None
        if self.probe is not None and quiet and now - max(self._probed_at, self._quiet_since) >= self.probe_every_s:
            self._probed_at = now
            self.probe()  # RankFailure: recovered by the caller (_guarded)
        idle = not e.has_unfinished() and not e.has_inflight()
        if not idle:
            self._idle_since, self._checked_idle = None, False
            return
        if self._idle_since is None:
            self._idle_since = now
        if not self._checked_idle and now - self._idle_since >= self.idle_check_after_s:
            try:
                e.check_invariants()
                if not e.is_idle_clean():
                    raise AssertionError(f"idle with pool units still allocated: {e.pool_usage()}")
            except AssertionError as err:
                self.invariant_error = str(err)
                log.error("pool invariant violated at idle: %s", err)
            self._checked_idle = True

    def stuck_reason(self) -> str | None:
        if self.invariant_error:
            return f"pool invariant violated: {self.invariant_error}"
        if self._blocked_since is not None and time.monotonic() - self._blocked_since > self.stuck_after_s:
            c = self.engine.counts()
            return (f"stuck: {c['waiting']} waiting and {c['retracted']} retracted requests, nothing running "
                    f"for {time.monotonic() - self._blocked_since:.0f} s (pools: {self.engine.pool_usage()})")
        return None

    def _deliver(self, outs, last: tuple[str, dict] | None = None) -> None:
        """Under the lock: one batch per consumer (step_feed.py) of the items for `outs` and then
        `last`, in order; a stream's last item ends it."""
        streams = self.streams
        batches: dict[Sink, list] = {}  # a sink is its own key (hashed by identity)
        item_of, unstreamed = self._item, []
        # one pass: an output whose request has no stream (any more) is dropped after the loop
        for o in outs:
            rid = o.req_id
            sink = streams.get(rid)
            if sink is None:
                unstreamed.append(o)
                continue
            batch = batches.get(sink)
            if batch is None:
                batch = batches[sink] = []
            batch.append((rid, item_of(o)))
            if o.finished or o.handoff is not None:  # `is_last` of the item
                self._end(streams, sink, rid, o.handoff is not None)
        if unstreamed:
            self._drop_unstreamed(unstreamed)
        if last is not None:
            rid, item = last
            sink = streams.get(rid)
            if sink is not None:
                batches.setdefault(sink, []).append(last)
                if is_last(item):
                    self._end(streams, sink, rid, "handoff" in item)
        gone = [sink for sink, batch in batches.items() if not sink.post(batch)]
        self.batches_posted += len(batches) - len(gone)
        for sink in gone:
            self._drop_consumer(sink)

    def _drop_consumer(self, sink: Sink) -> None:
        """Under the lock: a consumer whose event loop closed with streams still open (an
        in-process caller that never finalised them): its requests are aborted, as streams
        abandoned one by one are."""
        rids = [rid for rid, s in self.streams.items() if s is sink]
        log.warning("a consumer's event loop closed with %d streams open: aborting them", len(rids))
        for rid in rids:
            del self.streams[rid]
            self._end_request(rid)
            self.engine.finished_requests.pop(rid, None)
        self._local.pop(sink.aloop, None)
        if rids:
            self._deliver(self.engine.step_outputs_flush())

    def _end(self, streams: dict, sink: Sink, rid: str, handed_off: bool) -> None:
        """The stream of `rid` got its last item; `handed_off`: that item is its offer's hand-off,
        which the stream's gateway now carries (`reclaim_offers` once that gateway is gone)."""
        del streams[rid]
        if handed_off and sink.gateway is not None:
            self.engine.offer_carried_by(rid, sink.gateway)
        if sink.on_end is not None:
            sink.on_end(rid)

    def _drop_unstreamed(self, outs) -> None:
        """A request that ended with no stream to tell (its stream ended with its hand-off, and
        then it was aborted while offered): nothing is kept for a last item nobody will read."""
        for o in outs:
            if o.finished and o.req_id not in self.streams:
                self.engine.finished_requests.pop(o.req_id, None)
                self._abort_reasons.pop(o.req_id, None)

    def _item(self, o) -> dict:
        item = {"token_ids": o.new_token_ids, "finished": o.finished, "finish_reason": o.finish_reason}
        if o.handoff is not None:
            item["handoff"] = dict(o.handoff, source=self.source)
        if o.logprobs:
            item["logprobs"] = o.logprobs
        if o.finished:
            reason = self._abort_reasons.pop(o.req_id, None)
            if reason is None and o.finish_reason == "error":  # ended by a failure: never a silent empty answer
                reason = FAILED
            if reason is not None:
                item["error"], item["status"] = reason, 503
            req = self.engine.finished_requests.pop(o.req_id, None)
            if req is not None:
                item["text"] = req.text
                item["num_output_tokens"] = len(req.output_ids)
                item["num_prompt_tokens"] = len(req.prompt_ids)
        return item

    # ---- client API --------------------------------------------------------------------
    def submit(self, request_id: str, prompt_ids: list[int], params: dict, sink: Sink) -> None:
        """Start a request whose items go to `sink` with those of every other stream it holds."""
        def admit():
            try:
                sp = SamplingParams(**params)
            except TypeError as e:
                raise HyraxInputError(f"invalid sampling parameters: {e}") from None
            self.engine.add_request(prompt_ids, sp, request_id)
        self.open_stream(request_id, sink, admit)

    def submit_imported(self, handoff: dict, sink: Sink) -> None:
        """Take over a request exported by another replica and stream the rest of it to `sink`.
        Its first item acknowledges the import: {"imported": result, "token_ids": []}. A rank lost
        while loading its state is recovered at once (RANKS_FAILED): the request is ours all the
        same, rebuilt by prefill from its tokens with every other one."""
        rid = handoff["request"]["id"]

        def admit():
            taken = self.engine.take_back(handoff)  # its own offer, back: no other replica took it
            if taken is not None:
                return {"token_ids": [], "finished": False, "finish_reason": None, "imported": taken}
            # a request this loop ended while recovering (it gave up) is not acknowledged: the
            # source's offer is freed by its lease or the gateway, as for any import that fails
            own = _same_replica(handoff.get("source"), self.source)  # an offer of ours that recovery let go
            result = self._on_ranks(lambda: self.engine.import_request(handoff, own),
                                    lambda: Outcome.RANKS_FAILED if rid in self.engine.requests else None)
            if result is None:
                return None  # its stream ended with the error of the loop that gave up
            # the request is ours now (imported, or rebuilt by prefill from the tokens): tell the
            # source (not this replica itself: its offer is gone, and a late acknowledgement could
            # free a later offer of the same request)
            if handoff.get("source") is not None and not own:
                self.ack(handoff["source"], rid)
            return {"token_ids": [], "finished": False, "finish_reason": None, "imported": result}
        self.open_stream(rid, sink, admit)

    def open_stream(self, request_id: str, sink: Sink, admit: Callable[[], dict | None]) -> None:
        """Queue the stream of `request_id` (items to `sink`) and its admission, `admit`, which
        may return the stream's first item; the loop thread registers it and admits the request
        before its next step. The caller never waits for the lock: over Ray it is the
        coordinator's event loop, which also streams every other request's tokens and takes
        the next submissions, and a step in flight holds the lock for the whole step (with
        several requests arriving at once, each waited for a step of its own)."""
        self._opening.append((request_id, sink, admit))
        self.wake.set()
        if self.stopping:  # the loop thread admits nothing more (it may be gone): refuse it here
            with self.lock:
                self._open_streams(refuse=SHUTTING_DOWN)

    def _open_streams(self, refuse: str | None = None) -> None:
        """Under the lock: register and admit the queued streams, in arrival order (`refuse`, or
        the refusal of a closed loop: end each with this error instead, 503, marked as refused at
        admission: `step_feed.refusal_item`, which the gateway sends to another replica). A
        refusal (its abort came first, invalid input, no ranks) is the stream's one and last item."""
        while self._opening:
            request_id, sink, admit = self._opening.popleft()
            if sink is None:  # an acknowledgement queued by `release_soon`, not a stream
                self._guarded(admit)  # an error freeing the offer must not end the loop thread
                continue
            self.streams[request_id] = sink
            first = {"finished": True, "finish_reason": "abort", "token_ids": []}
            why = self.refusal or refuse  # (an admission before may have closed the loop)
            if why is not None:  # never admitted: the gateway may send it elsewhere
                first = refusal_item(why)
            elif not self.early_aborts.take(request_id):  # else its client left before it got here
                first = self._admit(request_id, admit)
            if first is not None:
                self._deliver([], (request_id, first))

    def _admit(self, request_id: str, admit: Callable[[], dict | None]) -> dict | None:
        """`admit()`, or the stream's last item when it raised. Anything but bad input is a bug
        (or a Ray caller's params that no check expected): it fails this stream, never the loop
        thread, and a request it left in the table goes (nobody would read it)."""
        known = request_id in self.engine.requests
        try:
            return admit()
        except HyraxInputError as e:
            return error_item(str(e))
        except Exception as e:  # noqa: BLE001
            log.exception("admitting %s failed", request_id)
            if not known and request_id in self.engine.requests:
                self.engine.abort(request_id)
            return error_item(f"the replica could not admit this request: {type(e).__name__}: {e}", 500)

    @contextlib.contextmanager
    def _turn(self):
        """The lock, the streams queued so far opened first: a command (an abort, a retraction,
        a listing) sees every request submitted before it, as when submitting took the lock.
        What the turn committed goes out before the lock is let go: a retraction or a resume
        commits the step in flight first (Engine.sync), and when that step was a request's
        last, nothing else would ever send its last tokens and its end (with nothing left to
        run there is no next step)."""
        with self.lock:
            self._open_streams()
            try:
                yield
            finally:
                self._deliver(self.engine.step_outputs_flush())

    def generate(self, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        """Async generator of {"token_ids", "finished", "finish_reason"[, "error"]} items (the
        stream itself, not a wrapper: closing it runs its cleanup then, not when collected)."""
        return self._stream(request_id, lambda sink: self.submit(request_id, prompt_ids, params, sink))

    def generate_imported(self, handoff: dict) -> AsyncIterator[dict]:
        """`submit_imported` for an in-process caller: the first item is {"imported": result}."""
        return self._stream(handoff["request"]["id"], lambda sink: self.submit_imported(handoff, sink))

    async def _stream(self, request_id: str, start):
        """One request's items for a caller on this event loop, fanned out from the one batch
        per step that this loop's consumer gets."""
        aloop = asyncio.get_running_loop()
        if aloop not in self._local:
            fan = Fanout()
            self._local[aloop] = (Sink(fan.dispatch, aloop), fan)
        sink, fan = self._local[aloop]
        q, done = fan.open(request_id), False
        try:
            start(sink)
            async for item in follow(q):
                done = is_last(item)
                yield item
        finally:
            fan.close(request_id, q)
            if not fan:
                self._local.pop(aloop, None)
            if not done:
                self._abandon(request_id)

    def _abandon(self, request_id: str) -> None:
        """A caller left before its stream's last item: abort the request if the stream had not
        ended here (a hand-off already offered is the lease's business)."""
        with self._turn():
            if self.streams.pop(request_id, None) is not None and self._end_request(request_id):
                self._deliver(self.engine.step_outputs_flush())
            self.engine.finished_requests.pop(request_id, None)

    # ---- commands (commands.py), dispatched by type -------------------------------------
    def run(self, cmd: Command):
        match cmd:  # one line per command type: the whole dispatch in one look
            case Retract(): return self.retract(cmd)
            case Resume(): return self.resume(cmd)
            case SetForcedRetraction(interval): return self.set_forced_retraction(interval)
            case MigrateOut(request_id, to): return self.migrate_out(request_id, to)
            case Abort(request_id): return self.abort(request_id)
            case ListRequests(): return self.list_requests()
            case Pools(): return self.pools()
            case Stats(): return self.stats()
            case Load(): return self.load()
            case FlushCache(): return self.flush_cache()
            case CachedPrefix(token_ids): return self.cached_prefix(token_ids)
        raise TypeError(f"not a replica command: {cmd!r}")

    def migrate_out(self, request_id: str, to: tuple[str, int] | None = None) -> bool:
        """Export a running request; its stream ends with the hand-off for the new replica (`to`,
        when one was asked for: its gateway offers it there). False when it is not running here
        (any more): unknown, finished, retracted, offered."""
        with self._turn():
            req = self.engine.requests.get(request_id)
            if req is None or request_id not in self.streams or req.state != State.RUNNING:
                return False
            # a rank lost during the export is recovered now, as in a step (the request is rebuilt)
            exported = self._guarded(lambda: self.engine.export_running(request_id))
            if exported is None:
                return False
            # tokens the export's sync committed go out first: the stream ends with the hand-off
            handoff = {"token_ids": [], "finished": False, "finish_reason": None,
                       "handoff": dict(exported, source=self.source)}
            if to is not None:
                handoff["to"] = to
            self._deliver(self.engine.step_outputs_flush(), (request_id, handoff))
        return True

    def release(self, request_id: str) -> bool:
        with self._turn():
            return self.engine.release_handoff(request_id)

    def reclaim_offers(self, gateway: str) -> list[str]:
        """`gateway` lost its lease here (its process is gone, or frozen past the lease): the
        offers whose hand-off it carries will reach no importer through it, so their state is
        freed now, as its streams are aborted, not when each offer's own lease ends. An
        importer's acknowledgement queued before is applied first (the turn opens what is queued:
        the offer is then the importer's, transferred); one that comes later finds no offer and
        changes nothing. The ids freed."""
        with self._turn():
            return self.engine.reclaim_offers_carried_by(gateway)

    def release_soon(self, request_id: str) -> None:
        """`release` for a caller that must not wait for the lock (the coordinator's event loop):
        queued with the streams, in arrival order, and applied at the loop's next turn, so an
        import of the same id that arrives after it (migrated away and back) finds the id free."""
        self._opening.append((request_id, None, lambda: self.engine.release_handoff(request_id)))
        self.wake.set()

    def abort(self, request_id: str, reason: str | None = None) -> bool:
        """End a request here. `reason`: why, when it was not its client's or an operator's
        doing; its stream's last item carries it as an error (status 503), so the client is
        told (the finish reason stays "abort")."""
        with self._turn():
            if reason is not None and request_id in self.engine.requests:
                self._abort_reasons[request_id] = reason  # its stream ends with the turn (_turn), even if this raises
            ok = self._end_request(request_id)
            if not ok and request_id not in self.streams:
                self.early_aborts.remember(request_id)
        return ok

    def _end_request(self, request_id: str) -> bool:
        """Under the lock: abort `request_id` in the engine; False if it is not there. Discarding
        its backup calls the ranks: a rank lost there is recovered, and the request ends anyway."""
        known = request_id in self.engine.requests
        return self._on_ranks(lambda: self.engine.abort(request_id), lambda: known)

    def retract(self, cmd: Retract) -> dict[str, Outcome]:
        """An operator's retraction: does what was asked, the last running request included. The
        ranks save the requests' state one request after the other: if one fails, the replica
        recovers and each request asked for answers as the failure left it (`_left_by_a_lost_rank`)."""
        which = cmd.selection
        with self._turn():
            ids = self._to_retract(which)  # chosen again below, but named if a rank fails before
            before: dict[str, State] = {}

            def retract_after_sync() -> dict[str, Outcome]:
                self.engine.sync()  # what runs is what the step in flight leaves running
                ids[:] = self._to_retract(which)
                before.update(self._states(ids))
                return self.engine.retract(ids, mode=cmd.mode, hold=cmd.hold)
            return self._on_ranks(retract_after_sync, lambda: self._left_by_a_lost_rank(ids, before, State.RUNNING))

    def _states(self, ids: list[str]) -> dict[str, State]:
        return {rid: req.state for rid in ids if (req := self.engine.requests.get(rid)) is not None}

    def _left_by_a_lost_rank(self, ids: list[str], before: dict[str, State], moved_from: State) -> dict[str, Outcome]:
        """Under the lock, once the replica recovered from a rank lost part way through an operator's
        retraction (`moved_from` RUNNING) or resume (RETRACTED) of `ids`, whose states were `before`
        the command's first move. A request the command moved before the rank was lost answers
        RECOMPUTE, its state gone with the rank: a retracted one stays retracted (and held, if that
        was asked) and a resume rebuilds it from its tokens; a resumed one is rebuilt so. Any other
        answers RANKS_FAILED: left as if the command had not been asked (not retracted; still held)."""
        def moved(rid: str) -> bool:
            req = self.engine.requests.get(rid)
            if req is None or before.get(rid) != moved_from:
                return False
            return req.state == State.RETRACTED if moved_from == State.RUNNING else req.state != State.RETRACTED
        return {rid: Outcome.RECOMPUTE if moved(rid) else Outcome.RANKS_FAILED for rid in ids}

    def _to_retract(self, which: Selection) -> list[str]:
        if which.all:
            return [r.id for r in self.engine.running]
        if which.count is not None:
            return [r.id for r in pick_victims(self.engine.running, which.count, keep_last=False)]
        return list(which.ids)

    def resume(self, cmd: Resume) -> dict[str, Outcome]:
        """Release retracted requests (oldest first for `count`). The ranks load their state one
        request after the other: if one fails, the replica recovers and each request asked for
        answers as the failure left it (`_left_by_a_lost_rank`)."""
        which = cmd.selection
        with self._turn():
            if which.all:
                ids = [r.id for r in self.engine.retracted]
            elif which.count is not None:
                ids = [r.id for r in self.engine.retracted[: which.count]]
            else:
                ids = list(which.ids)
            before = self._states(ids)
            out = self._on_ranks(lambda: self.engine.resume(ids),
                                 lambda: self._left_by_a_lost_rank(ids, before, State.RETRACTED))
        self.wake.set()
        return out

    def set_forced_retraction(self, interval: int) -> int:
        with self._turn():
            self.engine.set_forced_retraction(interval)
        return interval

    def list_requests(self) -> list[dict]:
        with self._turn():
            return self.engine.describe_requests()

    def pools(self) -> dict:
        with self._turn():
            return self.engine.pool_usage()

    def check_invariants(self) -> bool:
        """True when the pools' invariants hold; AssertionError when not. False: not checked, a
        rank failed when asked for its backups (the replica recovered)."""
        def check() -> bool:
            self.engine.check_invariants()
            return True
        with self._turn():
            return self._on_ranks(check, lambda: False)

    def is_idle_clean(self) -> bool:
        with self._turn():
            return (not self.engine.has_unfinished() and not self.engine.has_inflight()
                    and self.engine.is_idle_clean())

    def stats(self) -> dict:
        with self._turn():
            s = self.engine.stats.summary()
            s.update(self.engine.counts())
        steps = sorted(self.step_seconds)
        s["step_ms_p50"] = round(1000 * steps[len(steps) // 2], 3) if steps else None
        s["stuck"] = self.stuck_reason() is not None
        s["early_aborts_refused"] = self.early_aborts.refused
        s["stream_batches"] = self.batches_posted
        return s

    def flush_cache(self) -> dict[str, int]:
        with self._turn():
            return self.engine.flush_cache()

    def cached_prefix(self, token_ids) -> int:
        with self._turn():
            return self.engine.cached_prefix(list(token_ids))

    def load(self) -> int:
        """Requests queued or running: the router's measure of how busy this replica is."""
        c = self.engine.counts()
        return c["running"] + c["waiting"] + c["retracted"] + c["handoff"] + len(self._opening)

    def shutdown(self) -> None:
        self.stopping = True
        self.wake.set()
        self.thread.join(timeout=10)
