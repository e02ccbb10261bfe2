"""Gated DeltaNet (Qwen3-Next's linear attention).

in_proj_qkvz / in_proj_ba -> causal depthwise conv over [q | k | v] -> gated delta rule ->
per-head RMSNorm gated by silu(z) -> out_proj.

Per value head, with state S (k_head_dim x v_head_dim), q and k L2-normalised, q scaled by
k_head_dim^-1/2, decay g = -exp(A_log) * softplus(a + dt_bias) and beta = sigmoid(b):
    S_t = exp(g_t) S_{t-1};  S_t += k_t ⊗ beta_t (v_t - S_t^T k_t);  o_t = S_t^T q_t
Each key head serves num_v_heads / num_k_heads consecutive value heads.

State per request lives in two slot pools: `gdn_conv` ((conv_dim, kernel-1)) and `gdn_state`
((v_heads, k_head_dim, v_head_dim), float32/64). TP splits key heads (with their value heads).
Padding tokens get g = 0 and beta = 0, which leave S unchanged.
"""
from __future__ import annotations

import torch
from torch import nn

from hyrax.actors.model import sharding
from hyrax.actors.model.batch import ForwardBatch
from hyrax.actors.model.components import ComponentSpec, recurrent_pair
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.conv import capture_conv_states, causal_conv_step
from hyrax.actors.model.norm import AllReduce
from hyrax.actors.model.row_copy import index_copy_rows_
from hyrax.actors.model.sharding import TP


CONV, STATE = "gdn_conv", "gdn_state"  # the state components a Gated DeltaNet layer keeps


def state_components(cfg: ModelConfig, tp: TP, dtype: torch.dtype) -> list[ComponentSpec]:
    """This shard's Gated DeltaNet state: CONV (conv channels, kernel - 1) and STATE ((v_heads,
    k_head_dim, v_head_dim), float32/64), one slot per request, over every gated_deltanet layer."""
    layers = cfg.layers_of("gated_deltanet")
    if not layers:
        return []
    g = cfg.gdn
    return recurrent_pair(CONV, STATE, layers, dtype, sharding.gdn_conv_channels(cfg, tp), g.conv_kernel,
                          g.conv_dim, sharding.gdn_v_heads(cfg, tp), (g.k_head_dim, g.v_head_dim), g.num_v_heads,
                          captures_mid_step=True)


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                     state: torch.Tensor, snapshot=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The recurrence, token by token (prefill and decode share it). Updates `state` IN PLACE
    (the model passes the rows it gathered from its pool) and returns it.

    q, k: (B, T, H, Dk) (already expanded to value heads, normalised and scaled); v: (B, T, H, Dv);
    g, beta: (B, T, H); state: (B, H, Dk, Dv), contiguous. Returns o: (B, T, H, Dv) and the final
    state, both in state's dtype. Per token: S <- exp(g) S; S <- S + k (x) beta (v - k^T S);
    o = q^T S. The state is the step's largest tensor (16 MB at 16 sequences of 16 heads of
    128 x 128): scaled and updated in place, it is never allocated anew per token.
    `snapshot(t, state)`, if given, is called after each token t (a capture copies rows there).
    """
    f = state.dtype
    q, k, v, g, beta = (t.to(f) for t in (q, k, v, g, beta))
    B, H, Dk, Dv = state.shape
    s = state
    heads = s.view(B * H, Dk, Dv)
    out = []

    def read(x: torch.Tensor) -> torch.Tensor:
        """x^T S per head, (B, H, Dk) -> (B, H, Dv): a (1, Dk) x (Dk, Dv) product per head (the
        einsum "bhkv,bhk->bhv" ran as a batched matrix-vector product, 3-7x slower on the CPU)."""
        return torch.matmul(x.reshape(B * H, 1, Dk), heads).view(B, H, Dv)

    for t in range(q.shape[1]):
        s.mul_(g[:, t].exp()[..., None, None])
        delta = (v[:, t] - read(k[:, t])) * beta[:, t, :, None]
        heads.baddbmm_(k[:, t].reshape(B * H, Dk, 1), delta.reshape(B * H, 1, Dv))  # S += k (x) delta
        out.append(read(q[:, t]))
        if snapshot is not None:
            snapshot(t, s)
    return torch.stack(out, dim=1), s


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP, local_layer: int, dtype: torch.dtype, allreduce: AllReduce):
        super().__init__()
        g = cfg.gdn
        self.local_layer = local_layer
        self.nk = len(sharding.gdn_k_heads(cfg, tp))
        self.v_heads = list(sharding.gdn_v_heads(cfg, tp))
        self.nv = len(self.v_heads)
        self.dk, self.dv, self.r = g.k_head_dim, g.v_head_dim, g.num_v_heads // g.num_k_heads
        self.conv_ch = sharding.gdn_conv_channels(cfg, tp)
        self.qkvz_rows = sharding.gdn_in_proj_rows(cfg, tp, 2 * self.dk + 2 * self.r * self.dv)
        self.ba_rows = sharding.gdn_in_proj_rows(cfg, tp, 2 * self.r)
        self.v_ch = [h * self.dv + i for h in self.v_heads for i in range(self.dv)]
        h, c = cfg.hidden_size, len(self.conv_ch)
        self.in_proj_qkvz = nn.Linear(h, len(self.qkvz_rows), bias=False, dtype=dtype)
        self.in_proj_ba = nn.Linear(h, len(self.ba_rows), bias=False, dtype=dtype)
        self.conv1d = nn.Conv1d(c, c, g.conv_kernel, groups=c, bias=False, dtype=dtype)
        # per-head decay parameters stay float32 in bf16/fp16 models, as Mamba2's do (mamba2.py):
        # rounded to bf16 they put every head's decay off by up to 0.4 %, compounding per token
        decay_dtype = torch.promote_types(dtype, torch.float32)
        self.dt_bias = nn.Parameter(torch.ones(self.nv, dtype=decay_dtype), requires_grad=False)
        self.A_log = nn.Parameter(torch.zeros(self.nv, dtype=decay_dtype), requires_grad=False)
        self.norm = nn.Module()  # per value head RMSNorm (weight: (v_head_dim,)), gated by silu(z)
        self.norm.weight = nn.Parameter(torch.ones(self.dv, dtype=dtype), requires_grad=False)
        self.eps = cfg.rms_norm_eps
        self.out_proj = nn.Linear(len(self.v_ch), h, bias=False, dtype=dtype)
        self.allreduce = allreduce

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        return {
            "in_proj_qkvz.weight": (0, self.qkvz_rows), "in_proj_ba.weight": (0, self.ba_rows),
            "conv1d.weight": (0, self.conv_ch), "dt_bias": (0, self.v_heads), "A_log": (0, self.v_heads),
            "out_proj.weight": (1, self.v_ch),
        }

    def _gated_norm(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """o: (..., Dv) in the state dtype, z: (..., Dv) -> rmsnorm(o) * weight * silu(z), model dtype."""
        dtype = z.dtype
        h = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.norm.weight * h.to(dtype)
        f = torch.float64 if dtype == torch.float64 else torch.float32
        return (h.to(f) * nn.functional.silu(z.to(f))).to(dtype)

    def _snapshot(self, cap, into: torch.Tensor):
        """The recurrence's per-token hook for `cap`: after token t, the state rows of the
        captures whose point lies there are copied into their checkpoint rows."""
        at, rows, dst, pool = cap.at_token, cap.rows, cap.slots[STATE], into[self.local_layer]

        def snap(t: int, state: torch.Tensor) -> None:
            ix = at.get(t)
            if ix is not None:
                pool.index_copy_(0, dst.index_select(0, ix), state.index_select(0, rows.index_select(0, ix)))
        return snap

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pools: dict[str, torch.Tensor]) -> torch.Tensor:
        """x: (B, T, hidden) -> (B, T, hidden); updates this layer's conv and recurrent slots."""
        B, T, _ = x.shape
        nk, nv, dk, dv, r = self.nk, self.nv, self.dk, self.dv, self.r
        conv_pool = pools[CONV][self.local_layer]  # (slots, conv_dim, K-1)
        state_pool = pools[STATE][self.local_layer]  # (slots, Hv, Dk, Dv)
        qkvz = self.in_proj_qkvz(x).view(B, T, nk, 2 * dk + 2 * r * dv)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.in_proj_ba(x).view(B, T, nk, 2 * r).split([r, r], dim=-1)
        mixed = torch.cat([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], dim=-1)
        cap = batch.capture  # never in a decode step (T == 1): a capture lies inside a slice
        if cap is not None:  # the conv inputs up to each capture point, before the slots move on
            capture_conv_states(pools[cap.into[CONV]][self.local_layer], CONV, conv_pool, batch.slots[CONV], mixed, cap)
        mixed = causal_conv_step(mixed, conv_pool, batch.slots[CONV], batch.q_lens, self.conv1d.weight, None)
        q, k, v = mixed.split([nk * dk, nk * dk, nv * dv], dim=-1)
        f = state_pool.dtype
        q = l2norm(q.reshape(B, T, nk, dk).to(f)).repeat_interleave(r, dim=2) * dk ** -0.5
        k = l2norm(k.reshape(B, T, nk, dk).to(f)).repeat_interleave(r, dim=2)
        valid = batch.q_valid[..., None]
        beta = b.reshape(B, T, nv).sigmoid().to(f) * valid
        g = -self.A_log.to(f).exp() * nn.functional.softplus(a.reshape(B, T, nv).to(f) + self.dt_bias.to(f)) * valid
        slots = batch.slots[STATE]
        o, new_state = gated_delta_rule(q, k, v.reshape(B, T, nv, dv), g, beta, state_pool.index_select(0, slots),
                                        None if cap is None else self._snapshot(cap, pools[cap.into[STATE]]))
        index_copy_rows_(state_pool, slots, new_state)
        y = self._gated_norm(o, z.reshape(B, T, nv, dv))
        return self.allreduce(self.out_proj(y.reshape(B, T, nv * dv)))
