"""A slow, pure-torch implementation of the documented semantics of vllm-flash-attn 2.6's
`flash_attn_varlen_func` with a paged cache — the kernel itself needs CUDA, so the CPU tests
run our adapter (`attn_backends.FlashPaged`) against this instead; tests/gpu runs the real one.

Semantics implemented (from the function's docstring and the kernel's argument checks):
- q: (total_q, H, D); k/v cache: (num_blocks, page_size, KVH, D) with a contiguous last dim;
  page_size a multiple of 16 is NOT enforced here (the tiny test models use 4-token pages).
- cu_seqlens_q / cu_seqlens_k: int32 (B + 1,) prefix sums; with `block_table` (B, max_blocks,
  int32) sequence b's key j lives at k_cache[block_table[b, j // page], j % page].
- causal masks align to the bottom right: query i of a sequence with sq queries and sk keys
  sees key j when j <= i + sk - sq; window (left, right) keeps
  i + sk - sq - left <= j <= i + sk - sq + right; -1 means unbounded.
- GQA: query head h reads KV head h // (H // KVH).

The last key tile's block-table over-read of 2.6.2 (fixed upstream later) is an assertion
here, so an adapter that passes a table exactly as wide as the pages in use fails on CPU.

Deliberately pessimistic: every key of 0..sk-1 is gathered through the block table (also
rows the window masks out, as a kernel tile straddling the window start does) and masked
after QK^T, so masked rows still enter P @ V with probability 0.
"""
from __future__ import annotations

import torch

KV_TILE_ROWS = 256  # the kernel's largest key tile (kBlockN), written here independently of batch.py


def varlen_paged_reference(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None, *, out=None):
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not return_attn_probs and out is None
    assert block_table is not None and block_table.dtype == torch.int32 and block_table.stride(-1) == 1
    assert cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32
    assert q.dim() == 3 and k.dim() == 4 and k.shape == v.shape
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int)
    n_blocks, page, kvh, d = k.shape
    H = q.shape[1]
    assert q.shape[2] == d and H % kvh == 0
    scale = softmax_scale if softmax_scale is not None else d ** -0.5
    left, right = window_size
    result = torch.empty_like(q)
    for b in range(len(cu_seqlens_q) - 1):
        q0, q1 = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1])
        sk = int(cu_seqlens_k[b + 1]) - int(cu_seqlens_k[b])
        sq = q1 - q0
        assert 0 < sq <= max_seqlen_q and sq <= sk <= max_seqlen_k
        # 2.6.2 looks up the block table for every row of the sequence's last key tile (up to
        # KV_TILE_ROWS rows), also past its last page: a table narrower than that is over-read
        last_row = -(-sk // KV_TILE_ROWS) * KV_TILE_ROWS - 1
        assert last_row // page < block_table.shape[1], (
            f"sequence {b}: the last key tile reads block-table column {last_row // page}, past the "
            f"table's {block_table.shape[1]} columns")
        j = torch.arange(sk)
        blocks = block_table[b, j // page].long()
        assert bool(((blocks >= 0) & (blocks < n_blocks)).all()), "block table points outside the cache"
        keys = k[blocks, j % page].repeat_interleave(H // kvh, dim=1)  # (sk, H, D)
        vals = v[blocks, j % page].repeat_interleave(H // kvh, dim=1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1], keys) * scale
        i = torch.arange(sq)[:, None] + sk - sq  # each query's own key position
        ok = torch.ones(sq, sk, dtype=torch.bool)
        if causal:
            ok &= j[None, :] <= i
        if left >= 0:
            ok &= j[None, :] >= i - left
        if right >= 0:
            ok &= j[None, :] <= i + right
        p = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
        result[q0:q1] = torch.einsum("hqk,khd->qhd", p, vals)
    return result
