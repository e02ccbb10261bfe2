"""How one step's slices are split into the parts of its forward (non-deterministic mode).

Decode tokens (slices of one token) form one part, every longer slice (prompt chunks) a
second one, and a step with both runs them in ONE packed forward (`MixedBatch`, through
`HybridModel.forward`): the layers' token-wise work runs once on every real token, back to
back, so slices of different lengths cost their own tokens, not the longest one's, and the
forward's fixed cost - every layer's small ops and weight reads - is paid once a step.
Attention and any mixer that needs (B, T) rows run each part as its own batch: a decode token
padded to the longest chunk would multiply the step's work there. (Measured, bench Bamba:
before packing, a batch padded every slice to its longest and slices were split into batches
of similar length: a step of 512 prompt tokens in 5 slices ran 41-59 ms that way, 27-42 ms
packed; the decode tokens' own forward beside it cost 3.2 ms at 12 rows.)
"""
from __future__ import annotations


def length_groups(lengths: list[int]) -> list[list[int]]:
    """Indices of `lengths` (tokens per slice, each >= 1) split into forward batches: every
    index exactly once; the decode slices first, in their order, then the longer ones, in
    theirs."""
    ones = [i for i, n in enumerate(lengths) if n == 1]
    longer = [i for i, n in enumerate(lengths) if n > 1]
    return [g for g in (ones, longer) if g]
