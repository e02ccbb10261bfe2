"""Test-only fault: a rank that runs out of device memory on big steps.

`UnsafeFaults.oom_above_tokens` / `oom_above_requests` (refused unless `allow_unsafe`) wrap a
rank's runtime when it is built (`with_oom_fault`, called where ranks are made: the in-process
engine and `RankWorker.setup`), so the production rank has no fault branch. A step bigger than
the limit *runs* (every row of it is written: KV, window and recurrent state, the rank's last
tokens) and then raises `torch.OutOfMemoryError`: the worst case of a forward that ran out of
memory part-way, whose rows an engine must not continue from.
"""
from __future__ import annotations

import torch

from hyrax.actors.engine.config import UnsafeFaults
from hyrax.actors.engine.plan import StepPlan, StepResult


class OutOfMemoryAbove:
    """A rank runtime whose steps above `tokens` tokens or `requests` requests (0: no limit)
    raise `torch.OutOfMemoryError` after running. Every other call goes to the runtime."""

    def __init__(self, runtime, tokens: int, requests: int):
        self._runtime = runtime
        self.tokens, self.requests = tokens, requests
        self.raised = 0  # steps that raised

    def __getattr__(self, name):
        return getattr(self._runtime, name)

    def too_big(self, plan: StepPlan) -> bool:
        return bool((self.tokens and plan.num_tokens > self.tokens)
                    or (self.requests and plan.num_rows > self.requests))

    def execute(self, plan: StepPlan) -> StepResult:
        result = self._runtime.execute(plan)
        if self.too_big(plan):
            self.raised += 1
            raise torch.OutOfMemoryError(f"injected: a step of {plan.num_tokens} tokens, {plan.num_rows} requests "
                                         f"(limit {self.tokens} tokens, {self.requests} requests)")
        return result


def with_oom_fault(runtime, faults: UnsafeFaults, rank: int):
    """`runtime`, wrapped in `OutOfMemoryAbove` when `faults` ask for it on this rank."""
    if not (faults.out_of_memory and faults.applies_to(rank)):
        return runtime
    return OutOfMemoryAbove(runtime, faults.oom_above_tokens, faults.oom_above_requests)
