"""Which grammars rank 0 has compiled, as the coordinator knows it.

Rank 0 builds each structured-output request's grammar for the model's vocabulary (xgrammar's
compile: milliseconds for an ordinary schema, seconds to minutes for a large one). Compiled
inside the step that first samples the request, it held up that step, and with it every other
request on the replica. Now rank 0 compiles in a thread of its own (`GrammarMasks.prepare`), and
the coordinator does not schedule a request whose grammar is not compiled yet, as vLLM holds a
request until its grammar is ready: the rest of the batch runs on meanwhile.

The coordinator asks for each grammar once (`StepPlan.grammars`); rank 0 reports each one compiled
(or failed) in a step's result (`StepResult.grammars_ready` / `grammars_failed`). With nothing
else to run, the engine sends empty steps to hear it, `POLL_S` apart. Ranks restarted after a
loss compile nothing yet: `reset` asks again for every live request's grammar. Both sides keep
at most `KEEP` compiled grammars (least recently used go): one the coordinator still counts as
compiled but rank 0 let go of is compiled again inside the step, as before.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Iterable

from hyrax.actors.engine.grammar import GrammarSpec

KEEP = 1024
POLL_S = 0.005


class GrammarGate:
    def __init__(self, keep: int = KEEP, clock=time.monotonic):
        self.keep, self.clock = keep, clock
        self.ready: OrderedDict[GrammarSpec, None] = OrderedDict()  # compiled on rank 0 (LRU)
        self.pending: set[GrammarSpec] = set()  # asked, not reported yet
        self.failed: OrderedDict[GrammarSpec, str] = OrderedDict()  # rank 0 could not compile: why (LRU)
        self._to_ask: dict[GrammarSpec, None] = {}  # wanted, not asked yet (in order)
        self._last_poll = float("-inf")

    def want(self, spec: GrammarSpec | None) -> None:
        """A request that needs `spec` arrived (new, imported, rebuilt)."""
        if spec is None:
            return
        if spec in self.ready:
            self.ready.move_to_end(spec)
        elif spec not in self.pending:
            self._to_ask[spec] = None

    def asks(self) -> tuple[GrammarSpec, ...]:
        """The grammars for the next plan to ask rank 0 to compile (each once)."""
        if not self._to_ask:
            return ()
        out = tuple(self._to_ask)
        self._to_ask.clear()
        self.pending.update(out)
        return out

    def holds(self, spec: GrammarSpec | None) -> bool:
        """Whether a request with `spec` must wait: its grammar is not compiled yet (asked for
        again if it is not on its way: one compiled before may have been let go of since)."""
        if spec is None or spec in self.ready:
            return False
        if spec not in self.pending:
            self._to_ask[spec] = None
        return True

    @property
    def waiting(self) -> bool:
        """Some grammar is asked for or about to be: a step must carry the ask, or hear the answer."""
        return bool(self.pending or self._to_ask)

    def done(self, specs: Iterable[GrammarSpec]) -> None:
        for spec in specs:
            self.pending.discard(spec)
            self.ready[spec] = None
            self.ready.move_to_end(spec)
        _keep_newest(self.ready, self.keep)

    def fail(self, failed: Iterable[tuple[GrammarSpec, str]]) -> None:
        """Compiles that failed on rank 0: their requests end, and later ones are refused (`why`)."""
        for spec, why in failed:
            self.pending.discard(spec)
            self.failed[spec] = why
        _keep_newest(self.failed, self.keep)

    def why_not(self, spec: GrammarSpec | None) -> str | None:
        """Why rank 0 could not compile `spec`, if it could not."""
        return self.failed.get(spec) if spec is not None else None

    def pause_before_poll(self) -> None:
        """Before an empty step sent only to hear rank 0: waits out the rest of `POLL_S` since the
        last one (the loop has nothing else to do meanwhile; rank 0's compile has the CPU)."""
        now = self.clock()
        if now - self._last_poll < POLL_S:
            time.sleep(POLL_S - (now - self._last_poll))
        self._last_poll = self.clock()

    def reset(self, requests: Iterable) -> None:
        """New ranks (after a loss) have compiled nothing: ask again for every live request's grammar."""
        self.ready.clear()
        self.pending.clear()
        self._to_ask.clear()  # (what failed to compile fails on new ranks too: kept)
        for req in requests:
            self.want(req.params.grammar)


def _keep_newest(entries: OrderedDict, keep: int) -> None:
    """Drop the least recently used entries beyond `keep`."""
    while len(entries) > keep:
        entries.popitem(last=False)

