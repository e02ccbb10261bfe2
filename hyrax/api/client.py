"""The engine client the gateway talks to, injected at construction (STYLE §8).

A client routes requests over role replicas ("backends") and remembers which replica holds
each request, so aborts and admin calls reach the right one. Backends wrap either an
in-process `EngineLoop` (tests, single-process use) or a Ray `RoleCoordinator` handle
(`hyrax.cluster.ray_client`), behind the same calls: `generate`, `generate_imported`,
`health`, and `run(command)` for everything else, where a command is a typed value from
`hyrax.actors.engine.commands` (`Retract`, `Resume`, `ListRequests`, ...).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import AsyncIterator, Callable

from hyrax.actors.engine.commands import (Abort, Command, FlushCache, ListRequests, Load, MigrateOut, Pools, Resume,
                                          Retract, SetForcedRetraction, Stats)
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.selection import Selection
from hyrax.actors.engine.step_feed import error_item, is_refusal
from hyrax.api.cache_routing import RouteStats, pick_by_prefix
from hyrax.api.health import HealthReport, ReplicaHealth, ReplicaState, judge
from hyrax.api.request_owners import OFFERED, Owned, owners

log = logging.getLogger("hyrax.api")


class LocalBackend:
    unreachable: tuple[type[Exception], ...] = ()  # in process: a call that raises is a bug, never a lost replica

    def __init__(self, loop, role: str = "colocated", index: int = 0):
        self.loop, self.role, self.index = loop, role, index

    async def run(self, cmd: Command):
        return self.loop.run(cmd)

    def generate(self, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        return self.loop.generate(request_id, prompt_ids, params)

    def generate_imported(self, handoff: dict) -> AsyncIterator[dict]:
        return self.loop.generate_imported(handoff)

    async def health(self) -> dict:
        return {"role": self.role, "replica": self.index, "healthy": self.loop.healthy,
                "stuck": self.loop.stuck_reason()}


def _nowhere_to_go(handoff: dict, source) -> str:
    """Why a request handed off by `source` ends: no replica that decodes is in service."""
    if handoff.get("manifest") is None:  # handed off without state: its replica was lost
        return (f"the replica serving this request ({source.role}/{source.index}) was lost, and no other decode "
                f"or colocated replica is in service to continue it")
    return "no decode replica is in service to continue this request"


@dataclass
class ModelInfo:
    name: str
    max_model_len: int
    tokenizer: object
    chat_template: str | None
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        # the early context refusal's bound (text.fewest_tokens) is worked out once, here, when the
        # gateway starts: for a large vocabulary that takes a while, which the first request's
        # handler would otherwise spend on the event loop
        getattr(self.tokenizer, "max_bytes_per_token", None)


DECODING_ROLES = ("decode", "colocated")  # the roles that continue a request after its first token
UNREACHED = object()  # what `EngineClient._ask_all` gives for a replica that is gone
REFUSED = "refused a request at admission"  # why a replica is out of service after a refusal (public)
ARRIVAL_WAIT_S = 30.0  # how long a migration's answer waits to name the replica that took the request over
ARRIVAL_POLL_S = 0.02


def _moved(outcome: Outcome, target) -> str:
    """A migration's result as the admin API words it: `migrating to decode/1`."""
    return f"{outcome.value} to {target.role}/{target.index}" if target is not None else outcome.value


def least_loaded(backends: list, inflight: dict[int, int]) -> object:
    return min(backends, key=lambda b: (inflight.get(id(b), 0), b.index))


async def _close(stream) -> None:
    """Close a replica's stream this client stopped reading (an async generator's `aclose`: its
    `finally` runs at once; a stream without one has nothing to close)."""
    close = getattr(stream, "aclose", None)
    if close is not None:
        await close()


def _failed_abort(t: asyncio.Task) -> None:
    """An abort's failure, read (a replica that is gone fails it; its loss is reported elsewhere)."""
    if not t.cancelled() and t.exception() is not None:
        log.debug("an abort at shutdown failed: %r", t.exception())


class Unavailable(RuntimeError):
    """No replica can take the request now (503 with Retry-After)."""


@dataclass
class Reservation:
    """Admission for one API call's choices, counted against the in-flight limit until each
    choice ends. Releasing is idempotent, so every exit path may release what is left."""
    client: "EngineClient"
    left: int

    def release(self, n: int = 1) -> None:
        n = min(n, self.left)
        self.left -= n
        self.client.admitted -= n

    def release_all(self) -> None:
        self.release(self.left)


@dataclass
class EngineClient:
    model: ModelInfo
    backends: list
    router: Callable = least_loaded
    max_inflight: int = 1024  # choices (prompts x n) admitted and not yet finished
    max_choices: int = 256  # choices one API call may ask for
    inflight: dict[int, int] = field(default_factory=dict)
    owner: dict[str, object] = field(default_factory=dict)  # request id -> backend
    draining: set = field(default_factory=set)  # backend ids that take no new requests
    out_of_service: dict[int, ReplicaHealth] = field(default_factory=dict)  # backend id -> the check that took it out
    health_timeout_s: float = 5.0
    unresponsive_after: int = 3  # health checks missed in a row before a replica is taken out
    _missed: dict[int, int] = field(default_factory=dict)
    migrate_to: dict[str, object] = field(default_factory=dict)  # request id -> chosen target
    # requests aborted through this client: one that is handed off meanwhile goes nowhere
    aborting: set[str] = field(default_factory=set)
    admitted: int = 0
    _background: set = field(default_factory=set)  # fire-and-forget aborts, kept referenced
    # cache-aware first hop (cache_routing.py): requests in flight a replica with the longest cached
    # prefix may have beyond the least-loaded one; None routes by load alone
    cache_route_margin: int | None = 4
    route_stats: RouteStats = field(default_factory=RouteStats)

    def queue_full(self, n: int = 1) -> bool:
        return self.admitted + n > self.max_inflight

    def check_choices(self, n: int) -> None:
        """ValueError when one call asks for more choices than it may (the caller's fault, 400):
        more than `max_choices`, or than `max_inflight`, which no wait would ever admit."""
        limit = min(self.max_choices, self.max_inflight)
        if n > limit:
            raise ValueError(f"this request asks for {n} choices (prompts x n); the limit is {limit}")

    def reserve(self, n: int) -> Reservation:
        """Admit `n` choices or raise: ValueError past `max_choices` (the caller's fault, 400),
        Unavailable when the in-flight limit or the replicas cannot take them (503)."""
        self.check_choices(n)
        reason = self.unavailable()
        if reason is None and self.queue_full(n):
            reason = f"the server is at its limit of {self.max_inflight} requests in flight; retry later"
        if reason is not None:
            raise Unavailable(reason)
        self.admitted += n
        return Reservation(self, n)

    def unavailable(self) -> str | None:
        """Why a new request could not be served end to end now, or None."""
        if self._pick(("prefill",)) is None and self._pick(("colocated", "decode")) is None:
            return "no replica accepts requests (all draining or out of service)"
        if self._pick(("prefill",)) is not None and self._pick(("decode", "colocated")) is None:
            return "no decode replica accepts requests (all draining or out of service)"
        return None

    def _candidates(self, roles: tuple[str, ...], exclude: object = None, draining: bool = False) -> list:
        """Replicas of `roles` in service, other than `exclude`; `draining`: those draining too."""
        return [b for b in self.backends if b.role in roles and b is not exclude
                and (draining or id(b) not in self.draining) and id(b) not in self.out_of_service]

    def _pick(self, roles: tuple[str, ...], exclude: object = None):
        cands = self._candidates(roles, exclude)
        return self.router(cands, self.inflight) if cands else None

    def _first_hop_candidates(self) -> list:
        """Where a new request may run its prompt: the prefill replicas in service, else the
        colocated (or decode) ones."""
        return self._candidates(("prefill",)) or self._candidates(("colocated", "decode"))

    def _continuation_candidates(self, exclude: object) -> list:
        """Where a request already streaming may go on after a hand-off: the replicas that decode
        and accept requests, else those draining but in service. Draining keeps new requests out;
        failing one the server already started would be worse than letting it finish there (or be
        moved on by the drain)."""
        return self._candidates(DECODING_ROLES, exclude) or self._candidates(DECODING_ROLES, exclude, draining=True)

    def _continuation(self, exclude: object):
        """Where a request goes on after a hand-off with no target chosen (by load)."""
        cands = self._continuation_candidates(exclude)
        return self.router(cands, self.inflight) if cands else None

    def _next_try(self, tried: set[int], after_handoff: object = None):
        """Where a request goes after replicas in `tried` refused it at admission: for a new
        request, the first hop's kind (a prefill replica if one is in service, else a colocated
        or decode one); for a hand-off offered by `after_handoff`, a replica that continues it
        (`_continuation`). By load alone (the first hop's cache-aware decision is counted once
        per request); None when none is left."""
        cands = (self._continuation_candidates(after_handoff) if after_handoff is not None
                 else self._first_hop_candidates())
        cands = [b for b in cands if id(b) not in tried]
        return self.router(cands, self.inflight) if cands else None

    def _refused(self, b, item: dict) -> None:
        """`b` refused a request at admission (`step_feed.is_refusal`): its loop is closed (it went
        down, gave up, or is shutting down) or its actor is gone. Out of service at once, as a
        failed health check takes it; the next check that finds it healthy puts it back."""
        if id(b) not in self.out_of_service:  # else a health check's finding, which says more
            answer = {"role": b.role, "replica": b.index, "healthy": False, "last_error": item.get("error")}
            self.out_of_service[id(b)] = self._status(b, ReplicaState.UNHEALTHY, answer, REFUSED)

    async def _first_hop(self, prompt_ids: list[int]):
        """Where a new request runs its prompt: a prefill replica if there is one, else a
        colocated (or decode) one; among several, the one with the longest cached prefix unless it
        is too busy (cache_routing.py)."""
        cands = self._first_hop_candidates()
        if not cands:
            return None
        if self.cache_route_margin is None or len(cands) < 2:
            return self.router(cands, self.inflight)
        return await pick_by_prefix(cands, self.inflight, self.router, prompt_ids, self.cache_route_margin,
                                    self.route_stats)

    def _own(self, request_id: str, backend) -> None:
        old = self.owner.get(request_id)
        if old is not None:
            self.inflight[id(old)] -= 1
        if backend is not None:
            self.inflight[id(backend)] = self.inflight.get(id(backend), 0) + 1
            self.owner[request_id] = backend
        else:
            self.owner.pop(request_id, None)

    def _abort_later(self, backend, request_id: str) -> None:
        """Abort `request_id` on `backend` in the background. A replica that is gone fails it;
        its loss is supervision's to report, so the failure is read here and logged at debug
        (unread, asyncio printed it with a traceback as "Task exception was never retrieved")."""
        task = asyncio.ensure_future(backend.run(Abort(request_id)))
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.debug("abort of %s on %s/%s failed: %r", request_id, backend.role, backend.index, t.exception())
        task.add_done_callback(done)

    async def generate(self, request_id: str, prompt_ids: list[int], params: dict) -> AsyncIterator[dict]:
        """Stream one request. With prefill replicas, the prompt runs there and the request is
        offered to a decode replica after its first token; a migration offers it between
        decode replicas. The importer acknowledges to the source, coordinator to coordinator;
        this gateway only carries the offer. The consumer sees one uninterrupted stream of
        token items. If the consumer goes away, the request is aborted wherever it is.

        A replica that refuses the request (or its hand-off) at admission, its stream's first
        item a refusal (nothing of it ran there), is taken out of service and the request (or
        the same hand-off: the source still offers it) goes to another suitable replica, each
        tried once; the last refusal reaches the consumer when none is left (503). Nothing else
        is retried: an error after an item, or any other error, may follow an admission."""
        backend = await self._first_hop(prompt_ids)
        if backend is None:
            yield error_item("no replica accepts requests (all draining or out of service)", 503)
            return
        self._own(request_id, backend)
        stream, offered_by, done = backend.generate(request_id, prompt_ids, params), None, False
        carried, tried = None, set()  # the hand-off the next replica is offered; who refused this hop
        try:
            while True:
                handoff, asked, refusal, fresh = None, None, None, True  # fresh: nothing of this stream read yet
                failed_import = None  # an import's first item, an error: the source may take it back
                async for item in stream:
                    if fresh and is_refusal(item):
                        refusal = item
                        break
                    if (fresh and offered_by is not None and item.get("error") and request_id not in self.aborting
                            and self._taking_back(offered_by, backend, carried)):
                        failed_import = item  # the import failed there, so nothing of it runs there
                        break
                    fresh = False
                    if "imported" in item:  # the new replica has it; the source was told directly
                        offered_by = None
                        continue
                    if "handoff" in item:
                        handoff, asked = item.pop("handoff"), item.pop("to", None)
                        if item.get("token_ids"):
                            yield item
                        break
                    done = bool(item.get("finished"))
                    yield item
                await _close(stream)  # left early (a refusal, a hand-off): its cleanup runs now, not at GC
                if failed_import is not None:  # the source runs it on (it decodes; nowhere else was asked)
                    log.warning("request %s: %s/%s could not import it (%s); %s/%s runs it on", request_id,
                                backend.role, backend.index, failed_import.get("error"), offered_by.role,
                                offered_by.index)
                    backend = offered_by
                    self._own(request_id, backend)
                    stream = backend.generate_imported(carried)
                    continue
                if refusal is not None:  # it never ran there: another replica may take it
                    self._refused(backend, refusal)
                    tried.add(id(backend))
                    if request_id in self.aborting:  # aborted meanwhile (the abort went to the refuser)
                        done = True  # (an offer is freed below)
                        yield {"token_ids": [], "finished": True, "finish_reason": "abort"}
                        return
                    target = self._next_try(tried, offered_by) or self._taking_back(offered_by, backend, carried)
                    self.route_stats.refusals["answered" if target is None else "rerouted"] += 1
                    if target is None:  # none left: the refusal ends it (an offer is freed below)
                        done = True
                        yield refusal
                        return
                    backend = target
                    self._own(request_id, backend)
                    stream = (backend.generate_imported(carried) if offered_by is not None
                              else backend.generate(request_id, prompt_ids, params))
                    continue
                if handoff is None:
                    if not done:  # the replica's stream stopped short: an error, never a silently cut answer
                        yield error_item("the replica serving this request stopped before the request finished", 503)
                        return  # (not done: it is aborted wherever it may still be)
                    return
                if request_id in self.aborting:  # aborted while it was being handed off: it goes nowhere,
                    done, offered_by = True, backend  # and its source frees what it offered (below)
                    yield {"token_ids": [], "finished": True, "finish_reason": "abort"}
                    return
                offered_by, carried, tried = backend, handoff, set()
                target = (self.migrate_to.pop(request_id, None) or self._asked(asked, backend)
                          or self._continuation(exclude=backend) or self._taking_back(backend, None, handoff)
                          or self._rebuilder(backend, handoff))
                if target is None:  # nowhere to go: give it up cleanly rather than hold it
                    yield error_item(_nowhere_to_go(handoff, backend), 503)
                    return
                backend = target
                self._own(request_id, backend)
                stream = backend.generate_imported(handoff)
        finally:
            if not done:  # the consumer went away (or nowhere to go): free it wherever it is
                for b in {id(x): x for x in (backend, offered_by) if x is not None}.values():
                    self._abort_later(b, request_id)
            elif offered_by is not None:  # it ended before a next replica imported it (aborted at the
                self._abort_later(offered_by, request_id)  # hand-off, or the import refused): free the offer now
            self._own(request_id, None)
            self.migrate_to.pop(request_id, None)
            self.aborting.discard(request_id)

    def _taking_back(self, source, refuser, handoff: dict):
        """`source`, when it can run on `handoff`, a request it offered that no other replica
        took: it is in service and not the replica that just refused the offer, and it still
        holds the state (a hand-off without state comes from a replica that was lost). Else
        None. Its state never left it: it takes the hand-off back (transfer.py) and the client's
        stream goes on; a prefill replica then decodes the request to its end itself."""
        if (source is None or source is refuser or id(source) in self.out_of_service
                or handoff.get("manifest") is None):
            return None
        if source.role not in DECODING_ROLES:
            log.warning("request %s: no decode replica took its hand-off; %s/%s, which prefilled it, decodes it",
                        handoff["request"]["id"], source.role, source.index)
        return source

    def _rebuilder(self, lost, handoff: dict):
        """Where a request whose replica was lost (a hand-off without state) goes when no replica
        that decodes is in service: a prefill replica in service, which rebuilds it by prefill over
        its tokens and decodes it to its end itself (Engine.import_request), as it does a hand-off
        it takes back; else None."""
        if handoff.get("manifest") is not None:
            return None
        cands = self._candidates(("prefill",), exclude=lost)
        if not cands:
            return None
        log.warning("request %s: its replica %s/%s was lost and no decode replica is in service; a prefill "
                    "replica rebuilds and decodes it", handoff["request"]["id"], lost.role, lost.index)
        return self.router(cands, self.inflight)

    def find_backend(self, role: str, replica: int):
        for b in self.backends:
            if b.role == role and b.index == replica:
                return b
        return None

    def _asked(self, to: tuple[str, int] | None, source):
        """The replica a migration asked for in a hand-off (`MigrateOut.to`, through whichever
        gateway), if it may take it from `source` now; else None (the request goes by load)."""
        b = self.find_backend(*to) if to is not None else None
        return b if b is not None and b is not source and self.migration_refusal(b) is None else None

    def migration_refusal(self, target) -> tuple[int, str] | None:
        """Why a request cannot be moved to `target`, as (HTTP status, message), or None: only
        a replica that decodes and takes new work continues a request (a prefill replica
        never decodes; a request moved there would stall, holding its state)."""
        name = f"{target.role}/{target.index}"
        if target.role not in DECODING_ROLES:
            return 400, f"{name} is a {target.role} replica: a request moves only to a decode or colocated replica"
        if target not in self._candidates(DECODING_ROLES):
            return 409, f"{name} is draining or out of service"
        return None

    async def migrate(self, request_id: str, target=None, wait_s: float = ARRIVAL_WAIT_S,
                      source=None) -> tuple[Outcome, object]:
        """Move a running request to `target` (a backend that `migration_refusal` accepts;
        default: the least loaded other replica that decodes), whichever gateway streams it: the
        target travels with the hand-off to that gateway (`generate`, `_asked`). Returns (outcome,
        the replica that took the request over): `target`, unless it refused the hand-off and
        another replica took it; None when none had within `wait_s` (the request ended first, or
        is slow to arrive). `wait_s` 0: answer with the target at once. `source`: only from that
        replica (a drain's): a request that left it since (another gateway's drain moved it) is
        NOT_RUNNING there, and stays where it went."""
        src = self.owner.get(request_id)
        ours = src is not None
        if not ours:  # another gateway's request (or none): the replica holding it says
            held = (await self._owners()).get(request_id)
            if held is None:
                return Outcome.UNKNOWN, None
            src = held.replica
        if source is not None and src is not source:
            return Outcome.NOT_RUNNING, None
        if target is not None and self.migration_refusal(target) is not None:
            return Outcome.NO_TARGET, None
        if target is src:
            return Outcome.ALREADY_THERE, None
        target = target or self._pick(DECODING_ROLES, exclude=src)
        if target is None:
            return Outcome.NO_TARGET, None
        if request_id in self.migrate_to:  # already on its way: leave the target it goes to
            return Outcome.NOT_RUNNING, None
        if ours:  # before the export: its hand-off may come before the answer
            self.migrate_to[request_id] = target
        ok = False
        try:
            ok = await src.run(MigrateOut(request_id, (target.role, target.index)))
        finally:  # not exported (or no answer: a timeout, a rank failure): nothing is on its way
            if not ok:
                self.migrate_to.pop(request_id, None)
        if not ok:
            return Outcome.NOT_RUNNING, None
        if wait_s <= 0:
            return Outcome.MIGRATING, target
        arrived = await self._arrival(request_id, src, wait_s)
        return (Outcome.TAKEN_BACK if arrived is src else Outcome.MIGRATING), arrived

    async def _arrival(self, request_id: str, src, wait_s: float):
        """The replica that took `request_id` over from `src`: the first other one to own it
        (request_owners.py), or `src` itself when it took its offer back (no other replica
        took it). None when none did within `wait_s`, or when no replica holds it in two looks
        in a row (it ended; one look could miss it, the replicas answering one by one)."""
        aloop = asyncio.get_running_loop()
        deadline, missing = aloop.time() + wait_s, 0
        while True:
            held = (await self._owners()).get(request_id)
            if held is not None and held.row["state"] != OFFERED:  # (src: exported, so offered until taken back)
                return held.replica
            missing = missing + 1 if held is None else 0
            if missing >= 2 or aloop.time() >= deadline:
                return None
            await asyncio.sleep(ARRIVAL_POLL_S)

    async def drain(self, backend, wait_s: float = 30.0) -> dict:
        """Stop admitting to `backend`, migrate its running requests elsewhere, and wait (up
        to `wait_s`) until the ones on their way have left it (the replicas they move to took
        them); `remaining` is what it still holds then. What does not move (nowhere to go, not
        running: a request retracted and held stays until resumed; one another gateway's drain
        moved since the listing) is not waited for: with nothing on its way the drain answers at once."""
        self.draining.add(id(backend))
        reqs = await backend.run(ListRequests())
        moved, moving = {}, set()
        for r in reqs:  # whichever gateway streams it (`migrate`: the target travels with the hand-off)
            if r["state"] == "running":
                outcome, target = await self.migrate(r["id"], wait_s=0, source=backend)
                moved[r["id"]] = _moved(outcome, target)
                if outcome == Outcome.MIGRATING:
                    moving.add(r["id"])
        deadline = asyncio.get_running_loop().time() + wait_s
        left = set(moving)
        while left and asyncio.get_running_loop().time() < deadline:  # until the targets took them
            await asyncio.sleep(0.05)  # (or it took back one no other replica took: no longer offered)
            left &= {r["id"] for r in await backend.run(ListRequests()) if r["state"] == OFFERED}
        if moving:  # name where each went, which is not its target when that refused the hand-off
            now = await self._owners()
            for rid in moving:
                held = now.get(rid)
                if held is not None and held.row["state"] != OFFERED:
                    moved[rid] = _moved(Outcome.TAKEN_BACK if held.replica is backend else Outcome.MIGRATING,
                                        held.replica)
        remaining = await backend.run(Load())
        return {"draining": f"{backend.role}/{backend.index}", "migrations": moved, "remaining": remaining}

    async def undrain(self, backend) -> None:
        self.draining.discard(id(backend))

    async def abort(self, request_id: str) -> bool:
        """End a request this gateway streams, wherever it is: True if it streams it. Between
        two replicas it is never lost: offered by one (its stream ended with the hand-off), it
        ends at the hand-off instead of going on (`generate`); not yet imported by the next,
        that replica refuses the import when it comes (an abort that came first, loop.py)."""
        b = self.owner.get(request_id)
        if b is None:
            return False
        self.aborting.add(request_id)
        await b.run(Abort(request_id))
        return True

    async def end_streams(self, timeout_s: float) -> int:
        """Abort every request this gateway streams (its server is shutting down): each stream
        ends with finish_reason "abort" and its request is freed where it runs. Waits up to
        `timeout_s` for the replicas to answer. Returns how many requests were open."""
        ids = list(self.owner)
        if ids:
            tasks = [asyncio.ensure_future(self.abort(rid)) for rid in ids]
            await asyncio.wait(tasks, timeout=timeout_s)
            for t in tasks:  # a replica that is gone fails the abort: read, or asyncio prints a traceback
                t.add_done_callback(_failed_abort)
        return len(ids)

    async def retract(self, cmd: Retract) -> dict[str, Outcome]:
        """By ids: each on the replica that owns it. By count: replica by replica until that
        many are retracted. All: everywhere."""
        return await self._select(cmd)

    async def resume(self, cmd: Resume) -> dict[str, Outcome]:
        """The same selectors as `retract`: ids, a count (oldest retracted first), or all."""
        return await self._select(cmd)

    async def _select(self, cmd: Retract | Resume) -> dict[str, Outcome]:
        """Run `cmd` where its selection is: ids on the replicas that own them, a count replica
        by replica until that many succeeded, all on every replica."""
        which = cmd.selection
        if which.ids:
            return await self._by_owner(cmd)
        out: dict[str, Outcome] = {}
        remaining = which.count
        for b in self.backends:
            if remaining is not None and remaining <= 0:
                break
            sel = Selection(all=True) if remaining is None else Selection(count=remaining)
            got = await b.run(dataclasses.replace(cmd, selection=sel))
            out.update(got)
            if remaining is not None:
                remaining -= sum(1 for v in got.values() if Outcome(v).ok)
        return out

    async def _by_owner(self, cmd: Retract | Resume) -> dict[str, Outcome]:
        """Ids this gateway streams go to the replica it streams them from; any other id (another
        gateway's request on the same deployment, or none at all) is asked of every replica, and
        the one holding it answers (the others: unknown). The replica owns the request either way
        and keeps streaming it to its own gateway."""
        out: dict[str, Outcome] = {}
        groups: dict[int, list[str]] = {}
        elsewhere: list[str] = []
        for rid in cmd.selection.ids:
            b = self.owner.get(rid)
            if b is None:
                elsewhere.append(rid)
            else:
                groups.setdefault(id(b), []).append(rid)
        for b in self.backends:
            if id(b) in groups:
                out.update(await b.run(dataclasses.replace(cmd, selection=Selection(ids=tuple(groups[id(b)])))))
        if elsewhere:
            out.update({rid: Outcome.UNKNOWN for rid in elsewhere})
            asked = await self._ask_all(dataclasses.replace(cmd, selection=Selection(ids=tuple(elsewhere))))
            for _, got in asked:
                if got is not UNREACHED:
                    out.update({rid: v for rid, v in got.items() if Outcome(v) != Outcome.UNKNOWN})
        return out

    async def set_forced_retraction(self, interval: int) -> list[dict]:
        """Every replica retracts one request every `interval` steps (0: off); per replica,
        whether it took the setting (`reached`: false for one that is gone, see `_ask_all`)."""
        return [{"role": b.role, "replica": b.index, "reached": r is not UNREACHED}
                for b, r in await self._ask_all(SetForcedRetraction(interval))]

    async def flush_cache(self) -> list[dict]:
        """Every replica evicts the cached prefixes no request uses; units freed per replica
        (`reached`: false, and no count, for one that is gone)."""
        return [{"role": b.role, "replica": b.index, "reached": False} if r is UNREACHED
                else {"role": b.role, "replica": b.index, "reached": True, "freed": r}
                for b, r in await self._ask_all(FlushCache())]

    async def _ask_all(self, cmd: Command, among: list | None = None) -> list[tuple[object, object]]:
        """Send `cmd` to every replica (of `among`): (replica, answer) for each, in order, the answer
        UNREACHED for one its backend declares unreachable (`unreachable`: over Ray, its actor
        died or no answer within the call timeout), which is logged; its health says why. Any
        other exception is a bug: raised."""
        async def ask(b):
            try:
                return b, await b.run(cmd)
            except getattr(b, "unreachable", ()) as e:
                log.warning("%s/%s did not answer %s: %s", b.role, b.index, type(cmd).__name__, type(e).__name__)
                return b, UNREACHED

        return list(await asyncio.gather(*(ask(b) for b in (self.backends if among is None else among))))

    async def _views(self, cmd: Command, among: list | None = None) -> list[tuple[object, object]]:
        """Ask every replica for a view (requests, pools, stats): (replica, answer) for each
        that answered. One that is gone is left out (`_ask_all`), so the other replicas' views
        are still served (/metrics, /admin/pools, /admin/requests, the dashboard)."""
        return [(b, r) for b, r in await self._ask_all(cmd, among) if r is not UNREACHED]

    async def _owners(self) -> dict[str, Owned]:
        """Every replica's requests, each with its one owner (request_owners.py). The prefill
        replicas are asked first: one of their requests handed to a decode replica meanwhile is
        listed by one or the other (a prefill replica lets it go only once it was imported),
        never by neither."""
        prefill = [b for b in self.backends if b.role == "prefill"]
        others = [b for b in self.backends if b.role != "prefill"]
        return owners(await self._views(ListRequests(), prefill) + await self._views(ListRequests(), others))

    async def list_requests(self) -> list[dict]:
        """Every request once, as the replica that owns it now lists it, replica by replica."""
        place = {id(b): k for k, b in enumerate(self.backends)}
        out = []
        for b, r in sorted((await self._owners()).values(), key=lambda held: place.get(id(held.replica), len(place))):
            r.setdefault("role", b.role)
            r.setdefault("replica", b.index)
            out.append(r)
        return out

    async def pools(self) -> list[dict]:
        return [r if "components" in r else {"role": b.role, "replica": b.index, "tp_size": 1, "components": r}
                for b, r in await self._views(Pools())]

    async def stats(self) -> list[dict]:
        return [dict(s, role=b.role, replica=b.index) for b, s in await self._views(Stats())]

    async def health(self) -> HealthReport:
        """Ask every replica; take out of service (no new requests routed to it) one that
        reports itself unhealthy or stuck, or that missed `unresponsive_after` health checks in a
        row, and put it back once it answers healthy. Ready while some replica path can still
        serve a request end to end. The report's public view names each replica's state; its
        detail (the admin view) quotes the replicas' answers (health.py)."""
        async def ask(b):
            try:
                return await asyncio.wait_for(b.health(), self.health_timeout_s)
            except Exception as e:  # noqa: BLE001 - no answer in time counts as a missed check
                return {"role": b.role, "replica": b.index, "healthy": None, "last_error": type(e).__name__}

        answers = await asyncio.gather(*(ask(b) for b in self.backends))
        for b, answer in zip(self.backends, answers):
            self._judge(b, answer)
        return HealthReport(tuple(self._now(b, a) for b, a in zip(self.backends, answers)), self.unavailable())

    def _judge(self, b, answer: dict) -> None:
        """Take `b` out of service, or put it back, by its health answer (`healthy` None: none in time)."""
        key, state = id(b), judge(answer)
        if state == ReplicaState.UNRESPONSIVE:
            self._missed[key] = missed = self._missed.get(key, 0) + 1
            if missed >= self.unresponsive_after:
                why = (f"unresponsive ({missed} health checks in a row unanswered within "
                       f"{self.health_timeout_s:g} s)")
                self.out_of_service[key] = self._status(b, ReplicaState.UNRESPONSIVE, answer, why)
            elif key in self.out_of_service:  # already out: as it was, one more check missed
                self.out_of_service[key] = dataclasses.replace(self.out_of_service[key], missed_checks=missed)
            return
        self._missed.pop(key, None)
        if state == ReplicaState.HEALTHY:
            self.out_of_service.pop(key, None)
        else:
            self.out_of_service[key] = self._status(b, state, answer)

    def _status(self, b, state: ReplicaState, answer: dict, why_out: str | None = None,
                in_service: bool = False) -> ReplicaHealth:
        return ReplicaHealth(b.role, b.index, state, in_service, id(b) in self.draining, self._missed.get(id(b), 0),
                             why_out, answer)

    def _now(self, b, answer: dict) -> ReplicaHealth:
        """`b` after this round: out of service as the check that took it out found it, else in
        service (healthy, or unresponsive for fewer checks than take it out); draining as it is now."""
        out = self.out_of_service.get(id(b))
        if out is None:
            return self._status(b, judge(answer), answer, in_service=True)
        return dataclasses.replace(out, draining=id(b) in self.draining)
