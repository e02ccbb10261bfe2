"""A Mamba2 layer's causal convolution in C, on the pool's conv state rows in place
(kernels/causal_conv.c): `conv.causal_conv_step` without the gather of the states, the
(K-1+T)-long window copy, the per-tap passes and the scatter (a prefill step of 256 tokens
and 320 channels: see docs/architecture.md). The activation (silu) stays torch's own, which is
vectorised.
"""
from __future__ import annotations

import ctypes

import torch
from torch import nn

from hyrax.actors.model.native import ROW_KERNEL_ERRORS, function, raise_for, unavailable

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p


def kernel():
    """The C function (built on first use); raises NativeUnavailable."""
    return function("causal_conv", "hyrax_causal_conv_f32",
                    [_PTR, _I64, _PTR, _PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64])


def available() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    return unavailable("causal_conv")


def causal_conv_rows_(x: torch.Tensor, pool: torch.Tensor, rows: torch.Tensor, q_lens: torch.Tensor,
                      weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """`conv.causal_conv_step` for float32: x (B, T, C), each token's channels contiguous (a
    slice of in_proj's output is fine); pool (slots, C, K-1) float32, contiguous, rows (B,)
    int64 distinct, left holding each sequence's last K-1 inputs up to q_lens[b]; weight
    (C, 1, K); bias (C,) or None. Returns silu(conv(x)), (B, T, C) float32, contiguous."""
    B, T, C = x.shape
    K = weight.shape[-1]
    if x.dtype != torch.float32 or x.stride(2) != 1 or x.device.type != "cpu":
        raise ValueError("causal_conv: x must be float32 on the CPU with contiguous channels")
    if pool.dtype != torch.float32 or not pool.is_contiguous() or pool.shape[1:] != (C, K - 1):
        raise ValueError(f"causal_conv: the pool must be a contiguous float32 (slots, {C}, {K - 1}), "
                         f"got {pool.dtype} {tuple(pool.shape)}")
    if rows.shape != (B,) or rows.dtype != torch.int64 or q_lens.shape != (B,) or weight.shape != (C, 1, K):
        raise ValueError("causal_conv: inputs of mismatched shapes")
    taps = weight[:, 0].t().to(torch.float32).contiguous()  # (K, C)
    b = None if bias is None else bias.to(torch.float32).contiguous()
    rows, q_lens = rows.contiguous(), q_lens.to(torch.int64).contiguous()
    out = torch.empty(B, T, C, dtype=torch.float32)
    rc = kernel()(pool.data_ptr(), pool.shape[0], rows.data_ptr(), x.data_ptr(), x.stride(0), x.stride(1),
                  q_lens.data_ptr(), taps.data_ptr(), None if b is None else b.data_ptr(), out.data_ptr(), B, T, C, K)
    raise_for(rc, "causal_conv", ROW_KERNEL_ERRORS)
    return nn.functional.silu(out, inplace=True)
