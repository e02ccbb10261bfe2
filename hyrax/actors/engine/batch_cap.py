"""The engine's batch cap: how big a step may be now, lowered when a step runs out of device
memory and raised back slowly while steps succeed.

The cap is two numbers, the running requests admitted (`max_running`) and the tokens one step
runs (`max_batch_tokens`), never above what the configuration gives. An out-of-memory step
halves both from the size of *that* step (not from the cap, which the step may not have
filled), so every out-of-memory step makes the next attempt smaller. After `grow_after`
successful steps in a row the cap doubles, up to the configuration. A step that cannot be made
smaller (one request, and no fewer tokens allowed) is not retried: its request fails.

The scheduler is built from `config` (a copy of the engine's with the cap's numbers), so the
per-step path reads plain config fields, as it did without a cap.
"""
from __future__ import annotations

import dataclasses

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.plan import StepPlan
from hyrax.actors.engine.stats import BatchCapStats

GROW_AFTER = 64  # successful steps in a row before the cap doubles again


class BatchCap:
    def __init__(self, config: EngineConfig, stats: BatchCapStats, grow_after: int = GROW_AFTER):
        self.full = config
        self.stats = stats
        self.grow_after = grow_after
        # deterministic chunks end on multiples of prefill_chunk and run whole: a step never
        # takes fewer tokens than one chunk (the cap may not cut a chunk the request must run)
        self.min_tokens = config.prefill_chunk if config.deterministic else 1
        self.ok_steps = 0
        self._set(config.max_running, config.max_batch_tokens)

    def _set(self, running: int, tokens: int) -> None:
        self.running, self.tokens = running, tokens
        self.stats.max_running, self.stats.max_batch_tokens = running, tokens

    @property
    def config(self) -> EngineConfig:
        """The engine's config with the cap's numbers (prefill chunks no longer than the cap)."""
        return dataclasses.replace(self.full, max_running=self.running, max_batch_tokens=self.tokens,
                                   prefill_chunk=min(self.full.prefill_chunk, self.tokens))

    @property
    def lowered(self) -> bool:
        return (self.running, self.tokens) != (self.full.max_running, self.full.max_batch_tokens)

    def smallest(self, plan: StepPlan) -> bool:
        """`plan` is as small as a step can be: one request, no fewer tokens allowed."""
        return plan.num_rows <= 1 and plan.num_tokens <= max(self.min_tokens, 1)

    def shrink(self, plan: StepPlan) -> None:
        """`plan` ran out of memory: the cap becomes half of that step's size."""
        self._set(max(1, min(self.running, plan.num_rows // 2)),
                  max(self.min_tokens, min(self.tokens, plan.num_tokens // 2)))
        self.ok_steps = 0
        self.stats.shrinks += 1

    def step_ok(self) -> bool:
        """A step succeeded. True when the cap grew (the caller rebuilds what reads it)."""
        if not self.lowered:
            return False
        self.ok_steps += 1
        if self.ok_steps < self.grow_after:
            return False
        self._set(min(self.full.max_running, self.running * 2), min(self.full.max_batch_tokens, self.tokens * 2))
        self.ok_steps = 0
        self.stats.grows += 1
        return True
