"""How one step's slices are split into forward batches (non-deterministic mode).

Decode tokens (slices of one token) form one batch, every longer slice (prompt chunks) a
second one. The second batch runs packed (`HybridModel.forward`): the layers work on its real
tokens only, back to back, so slices of different lengths cost their own tokens, not the
longest one's, and one forward's fixed cost is paid once. (Before packing, a batch padded
every slice to its longest, and slices were split into batches of similar length instead:
a step of 512 prompt tokens in 5 slices ran 41-59 ms that way, 27-42 ms packed, bench Bamba.)
Decode tokens stay apart: in a packed batch, attention still gives its backend the queries
in (B, T) rows, and a decode token's row would be padded to the longest chunk there.
"""
from __future__ import annotations


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` (tokens per slice, each >= 1) split into forward batches: every
    index exactly once; the decode slices first, in their order, then the longer ones, in
    theirs."""
    ones = [i for i, n in enumerate(lengths) if n == 1]
    longer = [i for i, n in enumerate(lengths) if n > 1]
    return [g for g in (ones, longer) if g]
