"""A Mamba2 layer's decode step in C, between in_proj and out_proj (kernels/mamba2_decode.c).

Why: with one token per sequence, the layer's work between its two projections is a few
thousand multiply-adds per head, but as torch operations it is about thirty of them (split,
the convolution, silu, softplus, the decay, the state update, the readout, the skip, the gated
norm), each a dispatch and a pass over a small tensor: measured on the bench Bamba, one thread,
~0.3 ms a layer at one sequence, most of a decode step's Mamba2 time. The kernel runs each
sequence through all of it once, reading and writing its conv and SSM state rows where they lie
in the pools.

`mamba2_decode_rows_` checks every argument before the C code sees a pointer; the kernel checks
the pool rows it is given and writes nothing when one is out of range.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from hyrax.actors.model.native import ROW_KERNEL_ERRORS, function, raise_for, unavailable

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
NORM_MODES = {"gate_then_norm": 0, "norm_then_gate": 1, "gate_only": 2}
_ERRORS = {**ROW_KERNEL_ERRORS, -2: "an unknown norm mode, or a norm group that does not divide the channels"}


def kernel():
    """The C function (built on first use); raises NativeUnavailable."""
    return function("mamba2_decode", "hyrax_mamba2_decode_f32",
                    [_PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _F32, _F32,
                     _PTR, _F32, _I64, _I64, _PTR, _I64, _I64, _I64, _I64, _I64])


def available() -> str | None:
    """None when the kernel builds and loads here, else why not."""
    return unavailable("mamba2_decode")


@dataclass(frozen=True)
class DecodeWeights:
    """A layer's parameters as the kernel reads them, made once (`decode_weights`)."""

    taps: torch.Tensor  # (K, C) float32: conv tap k of every channel, contiguous
    conv_bias: torch.Tensor | None  # (C,)
    dt_bias: torch.Tensor  # (H,), and the two below
    A_log: torch.Tensor
    D: torch.Tensor
    norm_weight: torch.Tensor | None  # (H*P,); None for "gate_only"
    dt_lo: float
    dt_hi: float
    eps: float
    group: int
    mode: int  # NORM_MODES value
    heads: int


def decode_weights(conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                   A_log: torch.Tensor, D: torch.Tensor, dt_limits: tuple[float, float],
                   norm_weight: torch.Tensor | None, eps: float, group: int, mode: str) -> DecodeWeights:
    """conv_weight (C, 1, K), conv_bias (C,) or None; dt_bias, A_log, D (H,); dt_limits (lo, hi)
    for dt after softplus; norm_weight (channels,), None for "gate_only"; `group` channels per
    norm group; mode in NORM_MODES."""
    if mode not in NORM_MODES:
        raise ValueError(f"mamba2_decode: unknown norm mode {mode!r}; one of {sorted(NORM_MODES)}")
    C, K = conv_weight.shape[0], conv_weight.shape[-1]
    H = dt_bias.shape[0]
    if conv_weight.shape != (C, 1, K) or (conv_bias is not None and conv_bias.shape != (C,)) \
            or A_log.shape != (H,) or D.shape != (H,) or (mode != "gate_only" and norm_weight is None) \
            or group <= 0:
        raise ValueError("mamba2_decode: parameters of mismatched shapes")

    def f32(t):
        return None if t is None else t.detach().to(torch.float32).contiguous()

    return DecodeWeights(f32(conv_weight[:, 0].t()), f32(conv_bias), f32(dt_bias), f32(A_log), f32(D), f32(norm_weight),
                         float(dt_limits[0]), float(dt_limits[1]), float(eps), int(group), NORM_MODES[mode], H)


def mamba2_decode_rows_(zxbcdt: torch.Tensor, conv_pool: torch.Tensor, conv_rows: torch.Tensor,
                        ssm_pool: torch.Tensor, ssm_rows: torch.Tensor, w: DecodeWeights) -> torch.Tensor:
    """One token per sequence: zxbcdt (B, 1, H*P + C + H) float32, in_proj's output [z | xBC |
    dt] with C = H*P + 2*G*N conv channels, each row contiguous; conv_pool (slots, C, K-1) and
    ssm_pool (slots, H, P, N) float32, contiguous, addressed by conv_rows / ssm_rows (B,) int64,
    distinct, and advanced in place. Returns the gated, normed SSM output (B, 1, H*P) float32:
    what out_proj takes."""
    Bsz = zxbcdt.shape[0]
    _, H, P, N = ssm_pool.shape
    K, C = w.taps.shape
    inner = H * P
    G = (C - inner) // (2 * N)
    for name, pool in (("conv", conv_pool), ("ssm", ssm_pool)):
        if pool.dtype != torch.float32 or not pool.is_contiguous() or pool.device.type != "cpu":
            raise ValueError(f"mamba2_decode: the {name} pool must be a contiguous float32 CPU tensor, "
                             f"got {pool.dtype} {tuple(pool.shape)} on {pool.device}")
    if zxbcdt.dtype != torch.float32 or zxbcdt.device.type != "cpu" or zxbcdt.shape != (Bsz, 1, inner + C + H) \
            or zxbcdt.stride(2) != 1:
        raise ValueError(f"mamba2_decode: zxbcdt must be float32 on the CPU, (B, 1, {inner + C + H}) with "
                         f"contiguous rows, got {zxbcdt.dtype} {tuple(zxbcdt.shape)}")
    if H != w.heads or G < 1 or C != inner + 2 * G * N or H % G or conv_pool.shape[1:] != (C, K - 1) \
            or conv_rows.shape != (Bsz,) or ssm_rows.shape != (Bsz,) or conv_rows.dtype != torch.int64 \
            or ssm_rows.dtype != torch.int64 or (w.norm_weight is not None and w.norm_weight.shape != (inner,)):
        raise ValueError("mamba2_decode: inputs of mismatched shapes")
    conv_rows, ssm_rows = conv_rows.contiguous(), ssm_rows.contiguous()
    out = torch.empty(Bsz, 1, inner, dtype=torch.float32)
    rc = kernel()(zxbcdt.data_ptr(), zxbcdt.stride(0), conv_pool.data_ptr(), conv_pool.shape[0], conv_rows.data_ptr(),
                  w.taps.data_ptr(), _ptr(w.conv_bias), K, ssm_pool.data_ptr(), ssm_pool.shape[0], ssm_rows.data_ptr(),
                  w.dt_bias.data_ptr(), w.A_log.data_ptr(), w.D.data_ptr(), w.dt_lo, w.dt_hi, _ptr(w.norm_weight),
                  w.eps, w.group, w.mode, out.data_ptr(), Bsz, H, G, P, N)
    raise_for(rc, "mamba2_decode", _ERRORS)
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()
