"""Row scatter into a pool and row gather out of one, as wide elements.

`torch.Tensor.index_copy_` on the CPU moves one element per inner-loop iteration, so writing
rows of float32 costs about four times a plain copy of the same bytes. Rows are copied bit
for bit, so the element type does not matter: the pool and the rows are viewed as rows of the
widest type that divides a row's bytes (16-byte elements for every state row of the shipped
models) and scattered as such. Measured here, one thread, rows scattered into a pool of 68:
64 SSM rows of (8, 32, 32) float32 427 -> 107 us; 16 rows 104 -> 30 us; 64 conv rows of
(384, 3) 38 -> 15 us. `index_select` has the same per-element loop when a row is more than
one dimension: gathering 4,784 K/V rows of (2, 2, 32) float32 (a decode step's keys for 16
requests) took 3.8 ms as (rows, 2, 2, 32) and 0.12 ms as 16-byte elements.
"""
from __future__ import annotations

import math

import torch

# element types by size, widest first: a row is moved as the widest that divides it
WIDE = ((16, torch.complex128), (8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


def wide_dtype(row_bytes: int, *tensors: torch.Tensor) -> torch.dtype:
    """The widest element type that divides `row_bytes` and every tensor's start address."""
    return next(d for size, d in WIDE if row_bytes % size == 0 and all(t.data_ptr() % size == 0 for t in tensors))


def index_copy_rows_(pool: torch.Tensor, index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """pool[index[i]] = rows[i] along dim 0, in place; returns `pool`.

    pool: (R, *unit), contiguous; index: (n,) int64 on pool's device; rows: (n, *unit) of
    pool's dtype (made contiguous here). The same result as `pool.index_copy_(0, index, rows)`,
    which it is when autograd records the write (training: a reinterpreted view has no
    gradient) and inside a torch.compile graph (the compiler writes its own scatter loop, and
    a complex128 view is outside what it lowers)."""
    if traced_or_recorded(rows):
        return pool.index_copy_(0, index, rows)
    rows = rows.contiguous()
    unit = math.prod(pool.shape[1:])
    wide = wide_dtype(unit * pool.element_size(), pool, rows)
    pool.view(pool.shape[0], unit).view(torch.uint8).view(wide).index_copy_(
        0, index, rows.view(rows.shape[0], unit).view(torch.uint8).view(wide))
    return pool


def recorded(t: torch.Tensor) -> bool:
    """Whether autograd records work on `t` (a kernel without a backward must not touch it)."""
    return t.requires_grad and torch.is_grad_enabled()


def traced_or_recorded(t: torch.Tensor) -> bool:
    """Whether work on `t` must stay plain torch ops: autograd records it (a view of another
    dtype has no gradient), or a torch.compile graph is being traced (it writes its own loops,
    specialises on host values, and a complex128 view is outside what it lowers)."""
    return recorded(t) or torch.compiler.is_compiling()


def index_select_rows(pool: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """pool[index] along dim 0: (R, *unit), index (n,) int64 -> a new contiguous (n, *unit),
    the same as `pool.index_select(0, index)` (which it is under autograd or torch.compile)."""
    if traced_or_recorded(pool) or not pool.is_contiguous():
        return pool.index_select(0, index)
    unit = math.prod(pool.shape[1:])
    wide = wide_dtype(unit * pool.element_size(), pool)
    out = pool.view(pool.shape[0], unit).view(torch.uint8).view(wide).index_select(0, index)
    return out.view(torch.uint8).view(pool.dtype).view(index.shape[0], *pool.shape[1:])
