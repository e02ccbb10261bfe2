"""The SSD recurrence of a prefill step in C, on the pool's rows in place (kernels/ssd_scan.c).

Why: on the CPU the chunked scan (`ssd.ssd_chunked`) is a few dozen small torch operations per
layer, its within-chunk part quadratic in the chunk, plus a gather of the states before and a
scatter after. The recurrence itself is a few multiply-adds per state element and token; run
token by token with each (sequence, head) state kept in the core's cache, it costs less than
the operations' dispatch (bench Bamba, 256 tokens: 1.5 ms a layer -> see docs/architecture.md).

`ssd_scan_rows_` checks every argument before the C code sees a pointer; the kernel checks the
pool rows it is given and writes nothing when one is out of range.
"""
from __future__ import annotations

import ctypes

import torch

from hyrax.actors.model.native import ROW_KERNEL_ERRORS, function, raise_for, unavailable

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def kernel():
    """The C function (built on first use); raises NativeUnavailable."""
    return function("ssd_scan", "hyrax_ssd_scan_f32", [_PTR, _I64, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _PTR, _I64,
                                                      _I64, _I64, _I64, _I64, _I64, _I64, _PTR, _PTR, _PTR])


def available() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    return unavailable("ssd_scan")


def ssd_scan_rows_(pool: torch.Tensor, rows: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor,
                   Bm: torch.Tensor, Cm: torch.Tensor, D: torch.Tensor,
                   captures: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`ssd.ssd_chunked` for a step whose states are pool rows: sequence b starts from
    pool[rows[b]], which holds its state after the step. pool: (slots, H, P, N) float32,
    contiguous; rows: (B,) int64, distinct; x: (B, T, H, P); dt: (B, T, H), 0 at padding; A, D:
    (H,); Bm, Cm: (B, T, G, N). `captures` (seqs, lens): also the state of sequence seqs[i]
    after its first lens[i] tokens, (n, H, P, N). Returns (y (B, T, H, P) float32, the
    captured states or None)."""
    Bsz, T, H, P = x.shape
    G, N = Bm.shape[2], Bm.shape[3]
    if pool.dtype != torch.float32 or not pool.is_contiguous() or pool.shape[1:] != (H, P, N):
        raise ValueError(f"ssd_scan: the pool must be a contiguous float32 (slots, {H}, {P}, {N}), "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    if H % G or dt.shape != (Bsz, T, H) or Bm.shape != Cm.shape or Bm.shape[:2] != (Bsz, T) or A.shape != (H,) \
            or D.shape != (H,) or rows.shape != (Bsz,) or rows.dtype != torch.int64:
        raise ValueError("ssd_scan: inputs of mismatched shapes")
    tensors = (pool, rows, x, dt, A, Bm, Cm, D) + (captures or ())
    if any(t.device.type != "cpu" for t in tensors):
        raise ValueError("ssd_scan: every tensor must be on the CPU")
    f32 = [t.to(torch.float32).contiguous() for t in (x, dt, A, Bm, Cm, D)]
    rows = rows.contiguous()
    y = torch.empty(Bsz, T, H, P, dtype=torch.float32)
    if captures is None:
        seqs = lens = out = None
        n_cap = 0
    else:
        seqs, lens = (t.to(torch.int64).contiguous() for t in captures)
        n_cap = seqs.shape[0]
        out = torch.empty(n_cap, H, P, N, dtype=torch.float32)
    rc = kernel()(pool.data_ptr(), pool.shape[0], rows.data_ptr(), *(t.data_ptr() for t in f32[:5]),
                  f32[5].data_ptr(), y.data_ptr(), Bsz, T, H, G, P, N, n_cap,
                  None if seqs is None else seqs.data_ptr(), None if lens is None else lens.data_ptr(),
                  None if out is None else out.data_ptr())
    raise_for(rc, "ssd_scan", ROW_KERNEL_ERRORS)
    return y, out
