"""Decode attention on the CPU over the paged pool, in place (kernels/paged_decode.c).

`paged_decode` checks every argument's device, dtype, shape and layout before the C code
sees a pointer: the kernel trusts them, and checks only what depends on the values (a key on
a page that is not held, a row past the pool), which it reports without reading there.
"""
from __future__ import annotations

import ctypes

import torch

from hyrax.actors.model.native import function, raise_for, unavailable
from hyrax.actors.model.traced_ops import define

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
_ERRORS = {-1: "a visible key lies on a page the request does not hold",
           -2: "a key's row lies past the pool", -3: "no memory for the kernel's scratch"}


def kernel():
    """The C function (built on first use); raises NativeUnavailable."""
    return function("paged_decode", "hyrax_paged_decode_f32",
                    [_PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64, _F32])


def available() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    return unavailable("paged_decode")


def paged_decode(q: torch.Tensor, pool: torch.Tensor, table: torch.Tensor, first: torch.Tensor | None,
                 n_keys: torch.Tensor, qpos: torch.Tensor, page_size: int, window: int | None,
                 scale: float) -> torch.Tensor:
    """One query token per sequence: q (B, H, D) float32; pool (rows, 2, G, D) float32 (K and V
    of each row); table (B, P) int64 page table, -1 where a page is not held; first (B,) the
    position of each sequence's first key (None: 0); n_keys (B,) its number of keys; qpos (B,)
    the query's position. Sequence b attends to its keys at positions up to qpos[b], within
    `window` positions of it when given. Returns (B, H, D) float32; a sequence with no key
    gets zeros."""
    B, H, D = q.shape
    rows, two, G, Dp = pool.shape
    if two != 2 or Dp != D or H % G:
        raise ValueError(f"paged_decode: q {tuple(q.shape)} does not fit the pool {tuple(pool.shape)}")
    long = (table, n_keys, qpos) + (() if first is None else (first,))
    if (q.dtype, pool.dtype) != (torch.float32, torch.float32) or any(t.dtype != torch.int64 for t in long):
        raise ValueError("paged_decode: q and pool must be float32, the indices int64")
    if any(t.device.type != "cpu" for t in (q, pool, *long)):
        raise ValueError("paged_decode: every tensor must be on the CPU")
    if table.dim() != 2 or table.shape[0] != B or any(t.shape != (B,) for t in long[1:]):
        raise ValueError("paged_decode: table must be (B, P) and first, n_keys, qpos (B,)")
    if window is not None and window <= 0:
        raise ValueError(f"paged_decode: window must be positive, got {window}")
    if not pool.is_contiguous():
        raise ValueError("paged_decode: the pool must be contiguous")  # never a silent copy of a whole pool
    q, table, n_keys, qpos = (t.contiguous() for t in (q, table, n_keys, qpos))
    first = torch.zeros(B, dtype=torch.int64) if first is None else first.contiguous()
    out = torch.empty(B, H, D, dtype=torch.float32)
    rc = kernel()(q.data_ptr(), pool.data_ptr(), rows, table.data_ptr(), table.shape[1], first.data_ptr(),
                  n_keys.data_ptr(), qpos.data_ptr(), out.data_ptr(), B, H, G, D, page_size, window or 0, scale)
    raise_for(rc, "paged_decode", _ERRORS)
    return out


def _traced(q, pool, table, first, n_keys, qpos, page_size, window, scale):
    return paged_decode(q, pool, table, first, n_keys, qpos, page_size, window or None, scale)


# `paged_decode` as an operator (`hyrax::paged_decode`, traced_ops.py), so that a torch.compile'd
# decode forward (captured_decode.py) calls the kernel as one node instead of tracing the SDPA
# path in its place; None where this torch cannot define it. Same arguments; window 0: none
traced_paged_decode = define(
    "paged_decode", "(Tensor q, Tensor pool, Tensor table, Tensor? first, Tensor n_keys, Tensor qpos, "
    "int page_size, int window, float scale) -> Tensor", _traced, lambda q, *rest: q.new_empty(q.shape))
