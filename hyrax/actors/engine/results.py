"""A step's results applied to its requests, read against the step's own plan.

`Results.apply(plan, result)` walks the plan's entries (never live request fields that a
later step already advanced), advances each request that is still running, and reports
what the engine must do next: the new tokens per request, and the requests that stopped.
`StopRule` decides when a request is done; `StepOutput` is what a step hands to streams.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from hyrax.actors.engine.executor import StepResult
from hyrax.actors.engine.lifecycle import RequestTable
from hyrax.actors.engine.plan import START, STOPS, StepPlan
from hyrax.actors.engine.request import Request, State
from hyrax.actors.engine.stats import EngineStats
from hyrax.actors.engine.statecopy import releasable_pages
from hyrax.actors.model.state import ComponentSpec, WINDOW
from hyrax.actors.model.text_stream import TextStream


@dataclass
class StepOutput:
    req_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    handoff: dict | None = None  # set when the request was offered to another replica
    logprobs: list[dict] | None = None  # one per new token, when the request asked for them


@dataclass
class Applied:
    """What one step did: new tokens (and logprobs) per request in plan order, and the
    requests that stopped with their finish reason."""

    tokens: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[dict]] = field(default_factory=dict)
    stopped: list[tuple[Request, str]] = field(default_factory=list)


class StopRule:
    """When a request is done: a stop token, EOS, a stop string, max_tokens or the context."""

    def __init__(self, eos: set[int], max_model_len: int, decode: Callable[[list[int]], str] | None):
        self.eos = eos
        self.max_model_len = max_model_len
        self.decode = decode  # token ids -> text, for stop strings

    def reason(self, req: Request, tok: int) -> str | None:
        p = req.params
        if (tok in self.eos and not p.ignore_eos) or (p.stop_token_ids and tok in p.stop_token_ids):
            return "stop"
        if p.stop and self.decode is not None:
            scan = req.stop_scan  # decodes only the new token (an imported request: its outputs, once)
            if scan is None or len(scan.ids) != len(req.output_ids) - 1:
                scan = req.stop_scan = TextStream.after_prompt(self.decode, req.prompt_ids, tuple(p.stop))
                scan.feed(req.output_ids[:-1])
            scan.feed([tok])
            if scan.stopped:
                req.text = scan.emitted
                return "stop"
        if len(req.output_ids) >= p.max_tokens or req.num_tokens >= self.max_model_len:
            return "length"
        return None


class Results:
    """Applies steps' results to the requests of one replica."""

    def __init__(self, table: RequestTable, stats: EngineStats, stop: StopRule,
                 components: tuple[ComponentSpec, ...], page_size: int,
                 release: Callable[[str, dict[str, list[int]]], None], owned):
        self.table, self.stats, self.stop = table, stats, stop
        self.windows = tuple(c for c in components if c.kind == WINDOW)
        # the window lengths (rows) of the window components: a one-token step frees a page only
        # where it moves a window's first live row onto a new page (`_frees_page`)
        self._keep = tuple(c.window - 1 for c in self.windows)
        self.page_size = page_size
        self.release = release  # the engine's one free point
        self.owned = owned  # (request, pool, units) -> the units the request owns (not the prefix cache's)

    def apply(self, plan: StepPlan, result: StepResult) -> Applied:
        """Advance every request of `plan` that is still running by what the step computed
        and sampled."""
        out = Applied()
        tokens, lps = iter(result.tokens), result.logprobs
        row = -1  # this entry's index among the sampling entries (logprobs rows)
        now = time.monotonic()
        get, running, stop, windows = self.table.requests.get, State.RUNNING, self.stop.reason, self.windows
        # a checkpoint this step wrote (maybe inside its slice: before its end) goes to the prefix
        # cache with the window pages before it: those requests' pages leave after that
        # (`release_windows`), not here
        later = {w.req_id for w in plan.checkpoints} if windows and plan.checkpoints else ()
        new_tokens = out.tokens
        generated = 0
        block = plan.decode
        if block is not None:  # the decode block's rows first: one token each, every one sampled
            nb = len(block)
            generated += self._apply_block(block, result.tokens[:nb], lps, out, now)
            tokens, row = iter(result.tokens[nb:]), nb - 1
        for e in plan.entries:
            sample = e.sample
            if sample is not None:
                tok = next(tokens)
                row += 1
            req = get(e.req_id)
            if req is None or req.state is not running:
                continue  # aborted or retracted while the step ran
            end = req.num_computed = e.start + len(e.token_ids)
            if windows and req.id not in later and (end - e.start > 1 or self._frees_page(e.start)):
                self._release_window(req)
            if sample is None:
                continue
            req.output_ids.append(tok)
            generated += 1
            if req.first_token_at is None:
                req.first_token_at = now
            new_tokens[req.id] = [tok]  # a request has one entry per step
            if sample.logprobs is not None and row in lps:
                out.logprobs[req.id] = [lps[row]]
            reason = stop(req, tok)
            if reason:
                out.stopped.append((req, reason))
        self.stats.generation_tokens += generated
        return out

    def _apply_block(self, block, toks: list[int], lps: dict, out: Applied, now: float) -> int:
        """The decode block's rows (`apply`): one token each. `StopRule.reason` is asked only
        where it can say something - an EOS token, a request with stop ids or strings, one that
        reaches max_tokens or the context limit - and a window's pages are looked at only where
        its first live row moves to a new page (`_frees_page`)."""
        get, running, stop = self.table.requests.get, State.RUNNING, self.stop.reason
        eos, max_len = self.stop.eos, self.stop.max_model_len
        cols = block.ints[:, :STOPS + 1].tolist()  # start, draw, top_k, max_tokens, stops: one read
        frees = self._frees_pages([c[START] for c in cols]) if self._keep else ()
        generated = 0
        new_tokens, stopped = out.tokens, out.stopped
        for k, (rid, tok, (start, draw, _, limit, stops)) in enumerate(zip(block.req_ids, toks, cols)):
            req = get(rid)
            if req is None or req.state is not running:
                continue  # aborted or retracted while the step ran
            req.num_computed = start + 1
            if k in frees:
                self._release_window(req)
            req.output_ids.append(tok)
            generated += 1
            if req.first_token_at is None:
                req.first_token_at = now
            new_tokens[rid] = [tok]
            if k in lps:
                out.logprobs[rid] = [lps[k]]
            if tok in eos or stops or draw + 1 >= limit or start + 2 >= max_len:
                reason = stop(req, tok)
                if reason:
                    stopped.append((req, reason))
        return generated

    def release_windows(self, plan: StepPlan) -> None:
        """After the prefix cache took this step's checkpoints: the window pages `apply` left."""
        if not self.windows:
            return
        for w in plan.checkpoints:
            req = self.table.requests.get(w.req_id)
            if req is not None and req.state is State.RUNNING:
                self._release_window(req)

    def _frees_page(self, start: int) -> bool:
        """Whether a one-token step at position `start` moves the first live row of some window
        (start + 1 - keep, once the window is full) onto a new page. A step that moves none leaves
        nothing to release: pages left from before were released when their last row left (or,
        deferred behind a checkpoint, by `release_windows` in the same commit)."""
        ps = self.page_size
        if len(self._keep) == 1:
            keep = self._keep[0]
            return start >= keep and (start + 1 - keep) % ps == 0
        return any(start >= keep and (start + 1 - keep) % ps == 0 for keep in self._keep)

    def _frees_pages(self, listed: list[int]) -> set[int] | tuple:
        """The rows of one-token steps at positions `listed` for which `_frees_page` holds, with
        the rule inline for one window (the usual model): a set comprehension over the rows
        (~6 us at 64 rows warm) costs less than array operations (~7 warm, ~50 with the caches
        cold after a forward)."""
        ps = self.page_size
        if len(self._keep) == 1:
            keep = self._keep[0]
            return {k for k, s in enumerate(listed) if s >= keep and (s + 1 - keep) % ps == 0} or ()
        return {k for k, s in enumerate(listed) if self._frees_page(s)} or ()

    def _release_window(self, req: Request) -> None:
        """Pages of a window component whose positions all left the window go back."""
        for c in self.windows:
            table = req.indices[c.name]
            nums = releasable_pages(c, table, req.num_computed, self.page_size)
            if nums:
                self.release(req.id, {c.name: self.owned(req, c.name, [table[n] for n in nums])})
                table = list(table)
                for n in nums:
                    table[n] = -1
                req.indices[c.name] = tuple(table)  # a new table: one a view or plan holds never changes
