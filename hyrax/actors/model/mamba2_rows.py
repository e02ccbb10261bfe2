"""A Mamba2 layer's step in C, between in_proj and out_proj, on the pools' state rows in place
(kernels/mamba2_rows.c): decode steps (one token per sequence) and prefill steps.

Why: the layer's work between its two projections is a few multiply-adds per state element and
token, but as torch operations it is about thirty of them (split, the convolution, silu,
softplus, the decay, the state update and readout, the skip, the gated norm), each a dispatch
and a pass over a tensor, plus the copies between them. Measured on the bench Bamba, one
thread: ~0.3 ms a layer at one decoding sequence, most of a decode step's Mamba2 time; in a
256-token prefill, ~0.55 ms a layer around the C scan and convolution. The kernel runs each
sequence through all of it once, reading and writing its conv and SSM state rows where they lie
in the pools.

The wrappers check every argument before the C code sees a pointer; the kernel checks the pool
rows and lengths it is given and writes nothing when one is out of range.
"""
from __future__ import annotations

import ctypes
import weakref
from dataclasses import dataclass

import torch

from hyrax.actors.model.native import ROW_KERNEL_ERRORS, function, raise_for, unavailable
from hyrax.actors.model.traced_ops import define

_I64, _PTR, _F32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
NORM_MODES = {"gate_then_norm": 0, "norm_then_gate": 1, "gate_only": 2}
_ERRORS = {**ROW_KERNEL_ERRORS, -2: "an unknown norm mode, or a norm group that does not divide the channels",
           -5: "a sequence's tokens lie outside the step's rows (or it has none)"}
# the arguments both entry points share, after the in_proj rows and their strides
_SHARED = [_PTR, _I64, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR, _F32, _F32, _PTR, _F32, _I64, _I64]


def _decode_kernel():
    return function("mamba2_rows", "hyrax_mamba2_decode_f32", [_PTR, _I64, *_SHARED, _PTR, _I64, _I64, _I64, _I64, _I64])


def _prefill_kernel():
    return function("mamba2_rows", "hyrax_mamba2_prefill_f32",
                    [_PTR, _I64, _PTR, *_SHARED, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64, _I64])


def available() -> str | None:
    """None when the kernels build and load here, else why not."""
    return unavailable("mamba2_rows")


@dataclass(frozen=True)
class MixerWeights:
    """A layer's parameters as the kernels read them, made once (`mixer_weights`)."""

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


def mixer_weights(conv_weight: torch.Tensor, conv_bias: torch.Tensor | None, dt_bias: torch.Tensor,
                  A_log: torch.Tensor, D: torch.Tensor, dt_limits: tuple[float, float],
                  norm_weight: torch.Tensor | None, eps: float, group: int, mode: str) -> MixerWeights:
    """conv_weight (C, 1, K), conv_bias (C,) or None; dt_bias, A_log, D (H,); dt_limits (lo, hi)
    for dt after softplus; norm_weight (channels,), None for "gate_only"; `group` channels per
    norm group; mode in NORM_MODES."""
    if mode not in NORM_MODES:
        raise ValueError(f"mamba2_rows: unknown norm mode {mode!r}; one of {sorted(NORM_MODES)}")
    C, K = conv_weight.shape[0], conv_weight.shape[-1]
    H = dt_bias.shape[0]
    if conv_weight.shape != (C, 1, K) or (conv_bias is not None and conv_bias.shape != (C,)) \
            or A_log.shape != (H,) or D.shape != (H,) or (mode != "gate_only" and norm_weight is None) or group <= 0:
        raise ValueError("mamba2_rows: parameters of mismatched shapes")

    def f32(t):
        return None if t is None else t.detach().to(torch.float32).contiguous()

    return MixerWeights(f32(conv_weight[:, 0].t()), f32(conv_bias), f32(dt_bias), f32(A_log), f32(D), f32(norm_weight),
                        float(dt_limits[0]), float(dt_limits[1]), float(eps), int(group), NORM_MODES[mode], H)


def _checked(zxbcdt: torch.Tensor, conv_pool: torch.Tensor, conv_rows: torch.Tensor, ssm_pool: torch.Tensor,
             ssm_rows: torch.Tensor, w: MixerWeights, Bsz: int) -> tuple[list, tuple[int, int, int, int]]:
    """The arguments both kernels share, checked, for Bsz sequences: (the shared C arguments,
    (H, G, P, N))."""
    _, H, P, N = ssm_pool.shape
    K, C = w.taps.shape
    inner = H * P
    G = (C - inner) // (2 * N)
    for name, pool in (("conv", conv_pool), ("ssm", ssm_pool)):
        if pool.dtype != torch.float32 or not pool.is_contiguous() or pool.device.type != "cpu":
            raise ValueError(f"mamba2_rows: the {name} pool must be a contiguous float32 CPU tensor, "
                             f"got {pool.dtype} {tuple(pool.shape)} on {pool.device}")
    if zxbcdt.dtype != torch.float32 or zxbcdt.device.type != "cpu" or zxbcdt.dim() != 3 \
            or zxbcdt.shape[2] != inner + C + H or zxbcdt.stride(2) != 1:
        raise ValueError(f"mamba2_rows: zxbcdt must be float32 on the CPU, (B, T, {inner + C + H}) with "
                         f"contiguous rows, got {zxbcdt.dtype} {tuple(zxbcdt.shape)}")
    if H != w.heads or G < 1 or C != inner + 2 * G * N or H % G or conv_pool.shape[1:] != (C, K - 1) \
            or conv_rows.shape != (Bsz,) or ssm_rows.shape != (Bsz,) or conv_rows.dtype != torch.int64 \
            or ssm_rows.dtype != torch.int64 or (w.norm_weight is not None and w.norm_weight.shape != (inner,)):
        raise ValueError("mamba2_rows: inputs of mismatched shapes")
    conv_rows, ssm_rows = conv_rows.contiguous(), ssm_rows.contiguous()
    args = [conv_pool.data_ptr(), conv_pool.shape[0], conv_rows.data_ptr(), w.taps.data_ptr(), _ptr(w.conv_bias), K,
            ssm_pool.data_ptr(), ssm_pool.shape[0], ssm_rows.data_ptr(), w.dt_bias.data_ptr(), w.A_log.data_ptr(),
            w.D.data_ptr(), w.dt_lo, w.dt_hi, _ptr(w.norm_weight), w.eps, w.group, w.mode]
    return args, (H, G, P, N)


def mamba2_decode_rows_(zxbcdt: torch.Tensor, conv_pool: torch.Tensor, conv_rows: torch.Tensor,
                        ssm_pool: torch.Tensor, ssm_rows: torch.Tensor, w: MixerWeights) -> torch.Tensor:
    """One token per sequence: zxbcdt (B, 1, H*P + C + H) float32, in_proj's output [z | xBC |
    dt] with C = H*P + 2*G*N conv channels, each row contiguous; conv_pool (slots, C, K-1) and
    ssm_pool (slots, H, P, N) float32, contiguous, addressed by conv_rows / ssm_rows (B,) int64,
    distinct, and advanced in place. Returns the gated, normed SSM output (B, 1, H*P) float32:
    what out_proj takes."""
    if zxbcdt.dim() != 3 or zxbcdt.shape[1] != 1:
        raise ValueError(f"mamba2_rows: a decode step has one token per sequence, got {tuple(zxbcdt.shape)}")
    Bsz = zxbcdt.shape[0]
    args, (H, G, P, N) = _checked(zxbcdt, conv_pool, conv_rows, ssm_pool, ssm_rows, w, Bsz)
    out = torch.empty(Bsz, 1, H * P, dtype=torch.float32)
    rc = _decode_kernel()(zxbcdt.data_ptr(), zxbcdt.stride(0), *args, out.data_ptr(), Bsz, H, G, P, N)
    raise_for(rc, "mamba2_rows", _ERRORS)
    return out


def mamba2_prefill_rows_(zxbcdt: torch.Tensor, conv_pool: torch.Tensor, conv_rows: torch.Tensor,
                         ssm_pool: torch.Tensor, ssm_rows: torch.Tensor, q_lens: torch.Tensor,
                         w: MixerWeights) -> torch.Tensor:
    """A prefill step in the padded layout: zxbcdt (B, T, H*P + C + H) as for
    `mamba2_decode_rows_`, sequence b's first q_lens[b] (1 .. T) tokens real, the rest padding.
    Returns (B, T, H*P) float32, zero at padding; each sequence's conv and SSM rows are left as
    after its last real token."""
    B, T = zxbcdt.shape[:2]
    if q_lens.shape != (B,) or zxbcdt.stride(0) != T * zxbcdt.stride(1):
        raise ValueError("mamba2_rows: q_lens must hold one length per sequence of a (B, T, ...) step")
    starts = torch.arange(B, dtype=torch.int64) * T
    return _prefill(zxbcdt.view(1, B * T, -1), conv_pool, conv_rows, ssm_pool, ssm_rows, starts, q_lens, w,
                    zero=True).view(B, T, -1)


def mamba2_packed_rows_(zxbcdt: torch.Tensor, conv_pool: torch.Tensor, conv_rows: torch.Tensor,
                        ssm_pool: torch.Tensor, ssm_rows: torch.Tensor, starts: torch.Tensor, q_lens: torch.Tensor,
                        w: MixerWeights, out: torch.Tensor | None = None) -> torch.Tensor:
    """A prefill step in the packed layout: zxbcdt (1, N, H*P + C + H), the step's N tokens back
    to back, sequence b's at rows starts[b] .. starts[b] + q_lens[b] - 1. Returns (1, N, H*P)
    float32 (rows of no sequence uninitialised), written into `out` when given: so a step can
    run its sequences' tokens in several passes (a pass per capture point) into one output."""
    return _prefill(zxbcdt, conv_pool, conv_rows, ssm_pool, ssm_rows, starts, q_lens, w, zero=False, out=out)


def _prefill(zxbcdt, conv_pool, conv_rows, ssm_pool, ssm_rows, starts, q_lens, w: MixerWeights, zero: bool,
             out: torch.Tensor | None = None):
    args, (H, G, P, N) = _checked(zxbcdt, conv_pool, conv_rows, ssm_pool, ssm_rows, w, conv_rows.shape[0])
    Bsz, rows = conv_rows.shape[0], zxbcdt.shape[1]
    if zxbcdt.shape[0] != 1 or starts.shape != (Bsz,) or q_lens.shape != (Bsz,):
        raise ValueError("mamba2_rows: one start and one length per sequence over one row of tokens")
    starts, q_lens = starts.to(torch.int64).contiguous(), q_lens.to(torch.int64).contiguous()
    if out is None:
        out = (torch.zeros if zero else torch.empty)(1, rows, H * P, dtype=torch.float32)
    elif out.shape != (1, rows, H * P) or out.dtype != torch.float32 or not out.is_contiguous() \
            or out.device.type != "cpu":
        raise ValueError(f"mamba2_rows: out must be a contiguous float32 CPU tensor (1, {rows}, {H * P}), "
                         f"got {out.dtype} {tuple(out.shape)} on {out.device}")
    rc = _prefill_kernel()(zxbcdt.data_ptr(), zxbcdt.stride(1), starts.data_ptr(), *args, q_lens.data_ptr(),
                           out.data_ptr(), rows, Bsz, H, G, P, N)
    raise_for(rc, "mamba2_rows", _ERRORS)
    return out


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


# the kernels' parameter layouts for the traced op, by the parameters' identity and version:
# a compiled forward passes the parameters themselves (their data pointers are unknown while
# tracing), and the op makes the layout on its first call, not on every step. An entry keeps
# weak references to the parameters it was made from and serves only those same tensors: a
# parameter freed (a model dropped) and another made where it was, at the same version, has
# the same key but is not the tensor the entry was made from. A step calls the layers in order,
# so a cap below a model's Mamba2 layers misses on every call: it is above any checkpoint's
# (Falcon-H1's deep ones have 66 and 72).
_TRACED_WEIGHTS: dict[tuple, tuple[tuple, MixerWeights]] = {}
_TRACED_WEIGHTS_MAX = 256


def params_key(params: tuple) -> tuple:
    """What identifies a layer's parameters as they are now (each tensor's storage and version):
    the kernels' layout of them is remade when it changes."""
    return tuple((p.data_ptr(), p._version) if p is not None else None for p in params)


def _same_tensors(refs: tuple, params: tuple) -> bool:
    return all((r is None) if p is None else (r is not None and r() is p) for r, p in zip(refs, params))


def _traced_weights(params: tuple, dt_limits: tuple[float, float], eps: float, group: int, mode: str) -> MixerWeights:
    key = (params_key(params), dt_limits, eps, group, mode)
    hit = _TRACED_WEIGHTS.get(key)
    if hit is not None and _same_tensors(hit[0], params):
        return hit[1]
    _TRACED_WEIGHTS.pop(key, None)
    if len(_TRACED_WEIGHTS) >= _TRACED_WEIGHTS_MAX:  # parameters replaced (a reload): drop the oldest
        del _TRACED_WEIGHTS[next(iter(_TRACED_WEIGHTS))]
    w = mixer_weights(*params[:5], dt_limits, params[5], eps, group, mode)
    _TRACED_WEIGHTS[key] = (tuple(None if p is None else weakref.ref(p) for p in params), w)
    return w


def _traced_decode(zxbcdt, conv_pool, conv_rows, ssm_pool, ssm_rows, conv_weight, conv_bias, dt_bias, A_log, D,
                   norm_weight, dt_lo, dt_hi, eps, group, norm_mode):
    w = _traced_weights((conv_weight, conv_bias, dt_bias, A_log, D, norm_weight), (dt_lo, dt_hi), eps, group, norm_mode)
    return mamba2_decode_rows_(zxbcdt, conv_pool, conv_rows, ssm_pool, ssm_rows, w)


def _fake_decode(zxbcdt, conv_pool, conv_rows, ssm_pool, *rest):
    return zxbcdt.new_empty(zxbcdt.shape[0], 1, ssm_pool.shape[1] * ssm_pool.shape[2])


# `mamba2_decode_rows_` as an operator (`hyrax::mamba2_decode`, traced_ops.py) that writes the
# conv and SSM pool rows it is given, so that a torch.compile'd decode forward runs the C step
# as one node where it would otherwise trace the torch path (some thirty elementwise operations
# a layer, which inductor fuses but still runs as generated loops); None where this torch cannot
# define it. Arguments: those of mamba2_decode_rows_, the MixerWeights as the layer's parameters
traced_mamba2_decode = define(
    "mamba2_decode", "(Tensor zxbcdt, Tensor(a!) conv_pool, Tensor conv_rows, Tensor(b!) ssm_pool, "
    "Tensor ssm_rows, Tensor conv_weight, Tensor? conv_bias, Tensor dt_bias, Tensor A_log, Tensor D, "
    "Tensor? norm_weight, float dt_lo, float dt_hi, float eps, int group, str norm_mode) -> Tensor",
    _traced_decode, _fake_decode)
