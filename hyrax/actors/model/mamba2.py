"""Mamba2 mixer: in_proj -> causal depthwise conv -> SSD -> gated group RMSNorm -> out_proj.

Falcon-H1 variants (from the config): per-section multipliers on in_proj's output
[z | x | B | C | dt] (`cfg.mup.ssm_sections`), the norm applied before the gate or not at
all (`cfg.mamba_norm`), and an out_proj bias set apart from in_proj's.

State per request lives in two slot pools: `mamba_conv` (the last d_conv-1 conv inputs,
(conv_dim, d_conv-1)) and `mamba_ssm` ((heads, head_dim, d_state), float32/64). A step
reads each sequence's slot, runs its tokens (chunked scan when T > 1, the one-step update
when every sequence has one token) and writes the slot back.
"""
from __future__ import annotations

import torch
from torch import nn

from hyrax.actors.model import sharding
from hyrax.actors.model.batch import ForwardBatch
from hyrax.actors.model.components import ComponentSpec, recurrent_pair, ssm_dtype
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.causal_conv_rows import available as conv_unavailable
from hyrax.actors.model.causal_conv_rows import causal_conv_rows_
from hyrax.actors.model.conv import capture_conv_states, causal_conv_step
from hyrax.actors.model.mamba2_rows import available as step_unavailable
from hyrax.actors.model.mamba2_rows import (MixerWeights, mamba2_decode_rows_, mamba2_packed_rows_,
                                            mamba2_prefill_rows_, mixer_weights, params_key,
                                            traced_mamba2_decode)
from hyrax.actors.model.norm import AllReduce, GatedGroupRMSNorm, SiluGate
from hyrax.actors.model.row_copy import index_copy_rows_, traced_or_recorded
from hyrax.actors.model.sharding import TP
from hyrax.actors.model.ssd import ssd_chunked, ssd_states_at, ssd_step, ssd_step_rows_
from hyrax.actors.model.ssd_scan import available as scan_unavailable
from hyrax.actors.model.ssd_scan import ssd_scan_rows_


CONV, SSM = "mamba_conv", "mamba_ssm"  # the state components a Mamba2 layer keeps

# SSM state rows of at least this many bytes are stepped where they lie in the pool, one row
# at a time (`ssd_step_rows_`), when the pool is on the CPU. Measured, one thread, batch 16,
# per layer: 393 kB rows (the large bench Bamba) 5.7 -> 2.3 ms, 64 kB rows 1.7 -> 1.1 ms; the
# demo model's 32 kB rows (all 16 fit the L2 cache) 0.47 -> 0.60 ms, so they keep the gather.
ROWS_IN_PLACE_MIN_BYTES = 64 * 1024


def rows_on_host(pool: torch.Tensor, *inputs: torch.Tensor) -> bool:
    """Whether a step may address `pool`'s rows by host integers: a CPU pool (reading the slot
    ids costs no device wait), run eagerly (not traced by torch.compile, whose graph would
    specialise on them) and with no autograd recording writes into it from `inputs`."""
    return pool.device.type == "cpu" and not any(traced_or_recorded(t) for t in inputs)


def state_components(cfg: ModelConfig, tp: TP, dtype: torch.dtype) -> list[ComponentSpec]:
    """This shard's Mamba2 state: CONV (conv_dim channels, d_conv - 1) and SSM ((heads, head_dim,
    d_state), float32/64), one slot per request, over every mamba2 layer."""
    if not cfg.has_mamba:
        return []
    return recurrent_pair(CONV, SSM, cfg.layers_of("mamba2"), dtype, sharding.mamba_conv_channels(cfg, tp),
                          cfg.mamba_d_conv, cfg.mamba_conv_dim, sharding.mamba_heads(cfg, tp),
                          (cfg.mamba_d_head, cfg.mamba_d_state), cfg.mamba_n_heads, captures_mid_step=True)


def _section_scales(cfg: ModelConfig) -> torch.Tensor | None:
    """(2 * inner + 2 * G * N + H,) multipliers of the unsharded in_proj rows, or None if all 1."""
    m = cfg.mup.ssm_sections
    if all(v == 1.0 for v in m):
        return None
    gn = cfg.mamba_n_groups * cfg.mamba_d_state
    sizes = (cfg.mamba_intermediate, cfg.mamba_intermediate, gn, gn, cfg.mamba_n_heads)
    return torch.cat([torch.full((n,), float(v), dtype=torch.float64) for n, v in zip(sizes, m)])


class Mamba2Mixer(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP, local_layer: int, dtype: torch.dtype, allreduce: AllReduce,
                 device: torch.device | str = "cpu"):
        super().__init__()
        self.cfg = cfg
        self.local_layer = local_layer
        self.heads = list(sharding.mamba_heads(cfg, tp))
        self.inner_ch = sharding.mamba_inner_channels(cfg, tp)
        self.conv_ch = sharding.mamba_conv_channels(cfg, tp)
        self.in_rows = sharding.mamba_in_proj_rows(cfg, tp)
        self.n_groups_local = len(sharding.mamba_groups(cfg, tp))
        nh, inner, conv = len(self.heads), len(self.inner_ch), len(self.conv_ch)
        self.nh, self.inner, self.conv_dim = nh, inner, conv
        h = cfg.hidden_size
        self.in_proj = nn.Linear(h, len(self.in_rows), bias=cfg.mamba_proj_bias, dtype=dtype)
        self.conv1d = nn.Conv1d(conv, conv, cfg.mamba_d_conv, groups=conv, bias=cfg.mamba_conv_bias, dtype=dtype)
        # the per-head SSM parameters stay float32 in bf16/fp16 models (float64 ones keep float64):
        # a bf16 A_log puts A 0.4-1.5 % off, and a bf16 dt_bias rounds dt + dt_bias near -5 by
        # up to 2^-6, errors the recurrence compounds over every token
        ssm_param = torch.promote_types(dtype, torch.float32)
        self.dt_bias = nn.Parameter(torch.ones(nh, dtype=ssm_param), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(nh, dtype=ssm_param), requires_grad=False)
        self.D = nn.Parameter(torch.ones(nh, dtype=ssm_param), requires_grad=False)
        if cfg.mamba_norm == "gate_only":
            self.norm = SiluGate()
        else:
            self.norm = GatedGroupRMSNorm(
                inner, self.inner_ch[0], cfg.mamba_intermediate // cfg.mamba_n_groups, cfg.mamba_n_groups,
                cfg.rms_norm_eps, dtype, allreduce, norm_first=cfg.mamba_norm == "norm_then_gate",
            )
        self.out_proj = nn.Linear(inner, h, bias=cfg.mamba_out_bias and tp.rank == 0, dtype=dtype)
        self.allreduce = allreduce
        row_bytes = nh * cfg.mamba_d_head * cfg.mamba_d_state * torch.empty((), dtype=ssm_dtype(dtype)).element_size()
        self.rows_in_place = row_bytes >= ROWS_IN_PLACE_MIN_BYTES  # see ROWS_IN_PLACE_MIN_BYTES
        self.readout_transposed = False  # the decode readout's form: ssd_readout.plan_readouts measures it
        # on the CPU, where they build: the prefill steps' recurrence through the C scan (ssd_scan.py)
        # and every step's convolution through the C one (causal_conv_rows.py)
        self.native_kernels = torch.device(device).type == "cpu" and (scan_unavailable() or conv_unavailable()) is None
        # and, where its norm is one the kernels have, the whole of a step from in_proj's output to
        # out_proj's input through one C kernel (mamba2_rows.py): every decode and prefill step (one
        # with prefix-cache capture points inside its slices pass by pass, `_packed_step`)
        self.native_step = torch.device(device).type == "cpu" and self._kernel_norm() is not None \
            and step_unavailable() is None
        self._kernel_weights: tuple[tuple, MixerWeights] | None = None  # (parameter versions, weights)
        # per-row multipliers of in_proj's output (this rank's rows), None when all are 1
        scales = _section_scales(cfg)
        self.register_buffer("in_scale", None if scales is None else scales[self.in_rows].to(dtype), persistent=False)

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        return {
            "in_proj.weight": (0, self.in_rows), "in_proj.bias": (0, self.in_rows),
            "conv1d.weight": (0, self.conv_ch), "conv1d.bias": (0, self.conv_ch),
            "dt_bias": (0, self.heads), "A_log": (0, self.heads), "D": (0, self.heads),
            "norm.weight": (0, self.inner_ch), "out_proj.weight": (1, self.inner_ch),
        }

    def _kernel_norm(self) -> tuple[str, int] | None:
        """The step kernels' norm mode and group size for this layer's norm, None where it has
        none (a group split across TP ranks needs an all-reduce inside the norm)."""
        if isinstance(self.norm, SiluGate):
            return "gate_only", self.inner
        n = self.norm
        if n.split or self.inner % n.group_size or n.first % n.group_size:
            return None
        return ("norm_then_gate" if n.norm_first else "gate_then_norm"), n.group_size

    def _kernel_params(self) -> tuple:
        """(conv weight, conv bias, dt_bias, A_log, D, norm weight or None): what the step kernels
        read, in `mixer_weights`' order (eagerly, and as the traced operator's arguments)."""
        return (self.conv1d.weight, self.conv1d.bias, self.dt_bias, self.A_log, self.D,
                getattr(self.norm, "weight", None))

    def kernel_weights(self) -> MixerWeights:
        """The parameters as the step kernels read them, remade when one of them changed."""
        params = self._kernel_params()
        key = params_key(params)
        if self._kernel_weights is None or self._kernel_weights[0] != key:
            mode, group = self._kernel_norm()
            w = mixer_weights(*params[:5], self.cfg.time_step_limit, params[5], getattr(self.norm, "eps", 0.0),
                              group, mode)
            self._kernel_weights = (key, w)
        return self._kernel_weights[1]

    def discretize(self, dt: torch.Tensor, state_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """dt: (..., H) in_proj's dt section, in the model dtype -> (dt, A): the step sizes
        softplus(dt + dt_bias) within the config's limits, (..., H), and A = -exp(A_log), (H,).
        Both are computed in float32 (float64 for float64 models), never in bf16/fp16."""
        dt = nn.functional.softplus(dt.to(self.dt_bias.dtype) + self.dt_bias)
        lo, hi = self.cfg.time_step_limit
        if lo > 0.0 or hi != float("inf"):
            dt = dt.clamp(lo, hi)
        return dt, -torch.exp(self.A_log.to(state_dtype))

    def packed(self, x: torch.Tensor, batch: ForwardBatch, pools: dict[str, torch.Tensor]) -> torch.Tensor | None:
        """x: (1, N, hidden), a prefill step's real tokens back to back (HybridModel.forward) ->
        (1, N, hidden) through the C step, or None where it does not run (before any work):
        `forward` on the unpacked rows instead."""
        conv_pool, ssm_pool = pools[CONV][self.local_layer], pools[SSM][self.local_layer]
        if not (self.native_step and x.dtype == conv_pool.dtype == ssm_pool.dtype == torch.float32
                and rows_on_host(conv_pool, x) and rows_on_host(ssm_pool, x)):
            return None
        zxbcdt = self.in_proj(x)
        if self.in_scale is not None:
            zxbcdt = zxbcdt * self.in_scale
        return self.allreduce(self.out_proj(self._packed_step(zxbcdt, batch, pools, batch.starts)))

    def _packed_step(self, zxbcdt: torch.Tensor, batch, pools: dict[str, torch.Tensor],
                     starts: torch.Tensor) -> torch.Tensor:
        """The C step over a step's tokens back to back, zxbcdt (1, N, ...), each sequence's from
        `starts` -> (1, N, inner). With capture points (a prefix-cache checkpoint inside a slice),
        pass by pass (`batch.segments`): after each pass the state rows of every sequence whose
        run ended at a capture point are copied into that capture's checkpoint rows."""
        conv_pool, ssm_pool = pools[CONV][self.local_layer], pools[SSM][self.local_layer]
        w, cap = self.kernel_weights(), batch.capture
        if cap is None:
            return mamba2_packed_rows_(zxbcdt, conv_pool, batch.slots[CONV], ssm_pool, batch.slots[SSM], starts,
                                       batch.q_lens, w)
        out = torch.empty(1, zxbcdt.shape[1], self.inner, dtype=torch.float32)
        into = {name: pools[cap.into[name]][self.local_layer] for name in (CONV, SSM)}
        for seg in batch.segments:
            mamba2_packed_rows_(zxbcdt, conv_pool, seg.slots[CONV], ssm_pool, seg.slots[SSM], seg.starts, seg.lens,
                                w, out=out)
            if seg.into:  # some sequences' runs ended at capture points: their states, as they are now
                for name, pool in ((CONV, conv_pool), (SSM, ssm_pool)):
                    into[name].index_copy_(0, seg.into[name], pool.index_select(0, seg.sources[name]))
        return out

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pools: dict[str, torch.Tensor]) -> torch.Tensor:
        """x: (B, T, hidden) -> (B, T, hidden); updates this layer's conv and SSM slots."""
        cfg = self.cfg
        B, T, _ = x.shape
        P, N, G = cfg.mamba_d_head, cfg.mamba_d_state, self.n_groups_local
        conv_pool = pools[CONV][self.local_layer]  # (slots, conv_dim, d_conv-1)
        ssm_pool = pools[SSM][self.local_layer]  # (slots, H, P, N)
        conv_slots, ssm_slots = batch.slots[CONV], batch.slots[SSM]

        zxbcdt = self.in_proj(x)
        if self.in_scale is not None:
            zxbcdt = zxbcdt * self.in_scale
        cap = batch.capture  # never in a decode step (T == 1): a capture lies inside a slice
        if T == 1 and self.native_step and traced_mamba2_decode is not None and torch.compiler.is_compiling() \
                and zxbcdt.dtype == conv_pool.dtype == ssm_pool.dtype == torch.float32 \
                and conv_pool.device.type == "cpu":  # a compiled decode forward: the C step as one op
            mode, group = self._kernel_norm()
            y = traced_mamba2_decode(zxbcdt, conv_pool, conv_slots, ssm_pool, ssm_slots, *self._kernel_params(),
                                     *self.cfg.time_step_limit, getattr(self.norm, "eps", 0.0), group, mode)
            return self.allreduce(self.out_proj(y))
        # with capture points, the C step runs pass by pass over packed tokens: here, where no
        # slice is padded (the padded and packed layouts are then the same)
        if self.native_step and (cap is None or batch.token_index.shape[0] == B * T) \
                and zxbcdt.dtype == conv_pool.dtype == ssm_pool.dtype == torch.float32 \
                and rows_on_host(conv_pool, zxbcdt) and rows_on_host(ssm_pool, zxbcdt):
            if T == 1:
                y = mamba2_decode_rows_(zxbcdt, conv_pool, conv_slots, ssm_pool, ssm_slots, self.kernel_weights())
            elif cap is not None:
                y = self._packed_step(zxbcdt.reshape(1, B * T, -1), batch, pools, batch.starts).view(B, T, -1)
            else:
                y = mamba2_prefill_rows_(zxbcdt, conv_pool, conv_slots, ssm_pool, ssm_slots, batch.q_lens,
                                         self.kernel_weights())
            return self.allreduce(self.out_proj(y))
        z, xbc, dt = zxbcdt.split([self.inner, self.conv_dim, self.nh], dim=-1)

        if cap is not None:  # the conv inputs up to each capture point, before the slots move on
            capture_conv_states(pools[cap.into[CONV]][self.local_layer], CONV, conv_pool, conv_slots, xbc, cap)
        if self.native_kernels and xbc.dtype == conv_pool.dtype == torch.float32 and rows_on_host(conv_pool, xbc):
            xbc = causal_conv_rows_(xbc, conv_pool, conv_slots, batch.q_lens, self.conv1d.weight, self.conv1d.bias)
        else:
            xbc = causal_conv_step(xbc, conv_pool, conv_slots, batch.q_lens, self.conv1d.weight, self.conv1d.bias)
        xs, Bm, Cm = xbc.split([self.inner, G * N, G * N], dim=-1)

        dt, A = self.discretize(dt, ssm_pool.dtype)
        if T == 1:  # every sequence has its one token: no padding to mask
            step = (xs[:, 0].view(B, self.nh, P), dt[:, 0], A, Bm[:, 0].view(B, G, N), Cm[:, 0].view(B, G, N), self.D)
            if self.rows_in_place and rows_on_host(ssm_pool, xs, dt):
                y = ssd_step_rows_(ssm_pool, ssm_slots.tolist(), *step)[:, None]
            else:
                y, new_state = ssd_step(ssm_pool.index_select(0, ssm_slots), *step, self.readout_transposed)
                index_copy_rows_(ssm_pool, ssm_slots, new_state)
                y = y[:, None]
        elif self.native_kernels and ssm_pool.dtype == torch.float32 and rows_on_host(ssm_pool, xs, dt):
            dt = dt * batch.q_valid[..., None]  # padding: dt = 0 leaves the state unchanged
            y, at = ssd_scan_rows_(ssm_pool, ssm_slots, xs.view(B, T, self.nh, P), dt, A, Bm.view(B, T, G, N),
                                   Cm.view(B, T, G, N), self.D, None if cap is None else (cap.rows, cap.lens))
            if cap is not None:  # the state at each capture point, recorded as the scan passed it
                pools[cap.into[SSM]][self.local_layer].index_copy_(0, cap.slots[SSM], at)
        else:
            state = ssm_pool.index_select(0, ssm_slots)
            dt = dt * batch.q_valid[..., None]  # padding: dt = 0 leaves the state unchanged
            x4, B4 = xs.view(B, T, self.nh, P), Bm.view(B, T, G, N)
            out = ssd_chunked(x4, dt, A, B4, Cm.view(B, T, G, N), self.D, cfg.mamba_chunk_size, state,
                              with_starts=cap is not None)
            y, new_state = out[0], out[1]
            if cap is not None:  # the state at each capture point, from the start of its chunk
                pools[cap.into[SSM]][self.local_layer].index_copy_(0, cap.slots[SSM], ssd_states_at(
                    x4, dt, A, B4, out[2], cap.rows, cap.lens, cfg.mamba_chunk_size))
            index_copy_rows_(ssm_pool, ssm_slots, new_state)
        y = self.norm(y.reshape(B, T, self.inner), z)
        return self.allreduce(self.out_proj(y.to(x.dtype)))
