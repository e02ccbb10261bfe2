"""How one step's slices are split into forward batches (non-deterministic mode).

A forward pads every slice to the batch's longest, so a 40-token chunk next to a 256-token
one costs 256 positions. Splitting costs one more forward's fixed work instead (on CPU about
what 30 positions of a small model's prefill cost). So: decode tokens (length 1) form one
batch; longer slices, longest first, join the current batch while padding each to the
batch's longest wastes at most `pad_budget` positions, and start a new batch otherwise.
"""
from __future__ import annotations

PAD_BUDGET = 32  # positions of padding one slice may add before it gets a forward of its own


def length_groups(lengths: list[int], pad_budget: int = PAD_BUDGET) -> list[list[int]]:
    """Indices of `lengths` (tokens per slice, each >= 1) split into forward batches: every
    index exactly once; decode slices first, in their order; then the longer ones by length,
    longest first (ties in their order)."""
    ones = [i for i, n in enumerate(lengths) if n == 1]
    longer = sorted((i for i, n in enumerate(lengths) if n > 1), key=lambda i: -lengths[i])
    groups = [ones] if ones else []
    current: list[int] = []
    for i in longer:
        if current and lengths[current[0]] - lengths[i] > pad_budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    return groups
