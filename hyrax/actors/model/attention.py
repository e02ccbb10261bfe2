"""GQA attention (full or sliding-window) over paged K/V pools.

Pool layout per layer: (rows, 2, kv_heads, head_dim) — K and V of one token in one row.
The kernel that reads the pool is chosen once at construction (attn_backends.py):
`vllm_flash_attn` on CUDA when the `gpu` extra imports, else torch SDPA over gathered K/V,
which is also the CPU path and the oracle the tests compare against.
"""
from __future__ import annotations

import torch
from torch import nn

from hyrax.actors.model import sharding
from hyrax.actors.model.attn_backends import select_backend
from hyrax.actors.model.batch import ForwardBatch
from hyrax.actors.model.components import TOKEN, WINDOW, ComponentSpec
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.norm import AllReduce, RMSNorm
from hyrax.actors.model.row_copy import index_copy_rows_
from hyrax.actors.model.sharding import TP


# the state component each attention layer type keeps: K/V rows, paged
COMPONENT = {"full_attention": "full_kv", "sliding_attention": "swa_kv"}


def state_components(cfg: ModelConfig, tp: TP, dtype: torch.dtype) -> list[ComponentSpec]:
    """This shard's K/V: one row (2, kv_heads, head_dim) per token for full attention layers
    (token kind), per token of the last window for sliding-window layers (window kind)."""
    if not cfg.has_attention:
        return []
    kvh = sharding.kv_heads(cfg, tp)
    out = []
    for ltype, kind in (("full_attention", TOKEN), ("sliding_attention", WINDOW)):
        layers = cfg.layers_of(ltype)
        if layers:
            out.append(ComponentSpec(name=COMPONENT[ltype], kind=kind, layers=layers,
                                     unit_shape=(2, len(kvh), cfg.head_dim), dtype=dtype, shard_dim=1,
                                     shard_index=tuple(kvh), global_size=cfg.num_key_value_heads,
                                     window=cfg.sliding_window if kind == WINDOW else None))
    return out


def dense_reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None, scale: float) -> torch.Tensor:
    """Oracle for tests: causal (windowed) attention over a whole sequence, no cache.

    q: (T, H, D); k, v: (T, KVH, D) -> (T, H, D).
    """
    T = q.shape[0]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.einsum("thd,khd->htk", q, k) * scale
    i = torch.arange(T)[:, None]
    j = torch.arange(T)[None, :]
    ok = j <= i
    if window is not None:
        ok = ok & (i - j < window)
    s = s.masked_fill(~ok, float("-inf"))
    return torch.einsum("htk,khd->thd", torch.softmax(s, dim=-1), v)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP, layer_id: int, component: str, local_layer: int,
                 window: int | None, dtype: torch.dtype, allreduce: AllReduce,
                 device: torch.device | str = "cpu", backend: str = "auto"):
        super().__init__()
        hd = cfg.head_dim
        self.q_heads = list(sharding.q_heads(cfg, tp))
        self.kv_heads = list(sharding.kv_heads(cfg, tp))
        self.head_dim = hd
        self.component, self.local_layer, self.window = component, local_layer, window
        self.scale = cfg.softmax_scale
        self.use_rope = cfg.use_rope
        self.key_multiplier = cfg.mup.key  # Falcon-H1 scales K after k_proj
        h = cfg.hidden_size
        bias = cfg.attention_bias
        # with an output gate, q_proj yields [q | gate] per head (2 * head_dim rows each)
        self.q_width = 2 * hd if cfg.attn_output_gate else hd
        self.q_proj = nn.Linear(h, len(self.q_heads) * self.q_width, bias=bias, dtype=dtype)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, cfg.norm_offset)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype, cfg.norm_offset)
        self.qk_norm, self.output_gate = cfg.qk_norm, cfg.attn_output_gate
        self.k_proj = nn.Linear(h, len(self.kv_heads) * hd, bias=bias, dtype=dtype)
        self.v_proj = nn.Linear(h, len(self.kv_heads) * hd, bias=bias, dtype=dtype)
        self.o_proj = nn.Linear(len(self.q_heads) * hd, h, bias=bias and tp.rank == 0, dtype=dtype)
        self.allreduce = allreduce
        self.backend = select_backend(backend, device, dtype, hd)

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        hd = self.head_dim
        q = [h * hd + i for h in self.q_heads for i in range(hd)]
        q_rows = [h * self.q_width + i for h in self.q_heads for i in range(self.q_width)]
        kv = [h * hd + i for h in self.kv_heads for i in range(hd)]
        return {
            "q_proj.weight": (0, q_rows), "q_proj.bias": (0, q_rows),
            "k_proj.weight": (0, kv), "k_proj.bias": (0, kv),
            "v_proj.weight": (0, kv), "v_proj.bias": (0, kv),
            "o_proj.weight": (1, q),
        }

    def forward(self, x: torch.Tensor, batch: ForwardBatch, pools: dict[str, torch.Tensor], rope, cos_sin,
                packed: bool = False) -> torch.Tensor:
        """x: (B, T, hidden) -> (B, T, hidden). Writes this step's K/V into the pool first.

        cos_sin: the step's rotary tables from `rope.cos_sin(batch.positions)`, shared by all layers.
        `packed`: x is (1, N, hidden), the step's real tokens back to back, and cos_sin packed the
        same way (HybridModel.forward); the projections run on those tokens only, and the batch
        (a ForwardBatch, or a MixedBatch of decode rows and prompt slices) gives the backend the
        queries in its rows (`by_rows`).
        """
        B, T, _ = x.shape
        hd = self.head_dim
        q = self.q_proj(x).view(B, T, -1, self.q_width)
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
        k = self.k_proj(x).view(B, T, -1, hd)
        if self.key_multiplier != 1.0:
            k = k * self.key_multiplier
        v = self.v_proj(x).view(B, T, -1, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.use_rope:
            cos, sin = cos_sin
            q, k = rope.apply(q, cos, sin), rope.apply(k, cos, sin)
        pool = pools[self.component][self.local_layer]
        # the real tokens' K/V, (N, 2, kv_heads, head_dim), into their rows: index tensors made
        # once per step on the host (no boolean mask here, whose size only the device knows)
        kv = torch.stack((k, v), dim=2).reshape(B * T, 2, -1, hd)
        if packed:  # in packed order already; the backend runs over the batch's rows (each part's)
            index_copy_rows_(pool, batch.write_rows(self.component), kv.to(pool.dtype))
            out = batch.by_rows(lambda rows, part: self.backend(rows.contiguous(), pool, part.attn[self.component],
                                                                part, self.window, self.scale), q)
        else:
            idx = batch.attn[self.component]
            if T > 1:  # a decode step has no padding: token_index order
                kv = kv.index_select(0, batch.token_index)
            index_copy_rows_(pool, idx.write_rows, kv.to(pool.dtype))
            out = self.backend(q.contiguous(), pool, idx, batch, self.window, self.scale)
        if self.output_gate:
            out = out * torch.sigmoid(gate)
        return self.allreduce(self.o_proj(out.reshape(B, T, -1)))
