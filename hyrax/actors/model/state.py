"""Per-request state components, declared by layer type and derived from the config once.

This list is the core contract of Hyrax: every pool, backup, restore, transfer and
migration iterates `components` — nothing names a component by hand.

| component  | layers            | kind   | unit (local shard)        | sharded on        |
|------------|-------------------|--------|---------------------------|-------------------|
| full_kv    | full_attention    | token  | (2, kv_heads, head_dim)   | kv heads (dim 1)  |
| swa_kv     | sliding_attention | window | (2, kv_heads, head_dim)   | kv heads (dim 1)  |
| mamba_conv | mamba2            | slot   | (conv_dim, d_conv - 1)    | channels (dim 0)  |
| mamba_ssm  | mamba2            | slot   | (heads, head_dim, state)  | heads (dim 0)     |
| gdn_conv   | gated_deltanet    | slot   | (conv_dim, kernel - 1)    | channels (dim 0)  |
| gdn_state  | gated_deltanet    | slot   | (v_heads, k_dim, v_dim)   | v heads (dim 0)   |

A new recurrent layer type enters here and nowhere else in the state machinery: its
components are ordinary `slot` components, so backup, restore, checksums, transfer,
migration and re-sharding handle them with no special case.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from hyrax.actors.model import sharding
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.sharding import TP

TOKEN, WINDOW, SLOT = "token", "window", "slot"
KINDS = (TOKEN, WINDOW, SLOT)


@dataclass(frozen=True)
class ComponentSpec:
    """One kind of per-request state, as held by one TP rank.

    kind: `token` (one row per token, paged), `window` (rows for the last `window - 1`
    tokens only, paged, pages leaving the window are released), `slot` (one fixed-size
    row per request).
    """

    name: str
    kind: str
    layers: tuple[int, ...]
    unit_shape: tuple[int, ...]
    dtype: torch.dtype
    shard_dim: int
    shard_index: tuple[int, ...]  # global indices along shard_dim held by this rank
    global_size: int  # unsharded size of shard_dim
    window: int | None = None

    @property
    def paged(self) -> bool:
        return self.kind in (TOKEN, WINDOW)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one token, or one request's slot) over all layers of this rank."""
        return len(self.layers) * math.prod(self.unit_shape) * _itemsize(self.dtype)

    def live_rows(self, num_tokens: int) -> int:
        """Rows of state a request with `num_tokens` committed tokens holds (the byte formula)."""
        if self.kind == TOKEN:
            return num_tokens
        if self.kind == WINDOW:
            return min(num_tokens, self.window - 1)
        return 1

    def live_positions(self, num_tokens: int) -> range:
        """Token positions whose rows are live (paged kinds only)."""
        return range(num_tokens - self.live_rows(num_tokens), num_tokens)

    def global_unit_shape(self) -> tuple[int, ...]:
        s = list(self.unit_shape)
        s[self.shard_dim] = self.global_size
        return tuple(s)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ssm_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Recurrent state is kept in float32, or float64 when the model runs in float64."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def _recurrent_pair(prefix: str, layers: tuple[int, ...], dtype: torch.dtype, conv_channels: list[int],
                    kernel: int, conv_dim: int, heads, head_unit: tuple[int, int], n_heads: int,
                    state_name: str) -> list[ComponentSpec]:
    """A conv-state component ((channels, kernel - 1), sharded on channels) and a recurrent-state
    component ((heads, *head_unit), float32/64, sharded on heads), as Mamba2 and Gated DeltaNet keep."""
    return [
        ComponentSpec(name=f"{prefix}_conv", kind=SLOT, layers=layers, unit_shape=(len(conv_channels), kernel - 1),
                      dtype=dtype, shard_dim=0, shard_index=tuple(conv_channels), global_size=conv_dim),
        ComponentSpec(name=f"{prefix}_{state_name}", kind=SLOT, layers=layers, unit_shape=(len(heads), *head_unit),
                      dtype=ssm_dtype(dtype), shard_dim=0, shard_index=tuple(heads), global_size=n_heads),
    ]


def derive_components(cfg: ModelConfig, tp: TP = TP(), dtype: torch.dtype = torch.float32) -> tuple[ComponentSpec, ...]:
    """The ordered component list of a model shard. The only place components are defined."""
    out: list[ComponentSpec] = []
    if cfg.has_attention:
        kvh = sharding.kv_heads(cfg, tp)
        for name, kind, ltype in (("full_kv", TOKEN, "full_attention"), ("swa_kv", WINDOW, "sliding_attention")):
            layers = cfg.layers_of(ltype)
            if layers:
                out.append(ComponentSpec(
                    name=name, kind=kind, layers=layers,
                    unit_shape=(2, len(kvh), cfg.head_dim), dtype=dtype,
                    shard_dim=1, shard_index=tuple(kvh), global_size=cfg.num_key_value_heads,
                    window=cfg.sliding_window if kind == WINDOW else None,
                ))
    if cfg.has_mamba:
        out += _recurrent_pair(
            "mamba", cfg.layers_of("mamba2"), dtype,
            sharding.mamba_conv_channels(cfg, tp), cfg.mamba_d_conv, cfg.mamba_conv_dim,
            sharding.mamba_heads(cfg, tp), (cfg.mamba_d_head, cfg.mamba_d_state), cfg.mamba_n_heads, "ssm")
    if cfg.layers_of("gated_deltanet"):
        g = cfg.gdn
        out += _recurrent_pair(
            "gdn", cfg.layers_of("gated_deltanet"), dtype,
            sharding.gdn_conv_channels(cfg, tp), g.conv_kernel, g.conv_dim,
            sharding.gdn_v_heads(cfg, tp), (g.k_head_dim, g.v_head_dim), g.num_v_heads, "state")
    return tuple(out)


# ---- predicates: one definition each, used by startup validation and runtime alike ----------

def has_recurrent_state(components: tuple[ComponentSpec, ...]) -> bool:
    """True when some component is a per-request slot (state that cannot be recomputed per token)."""
    return any(c.kind == SLOT for c in components)


def component_by_name(components: tuple[ComponentSpec, ...]) -> dict[str, ComponentSpec]:
    return {c.name: c for c in components}


def bytes_formula(components: tuple[ComponentSpec, ...], num_tokens: int) -> dict[str, int]:
    """Exact bytes of one rank's share of a request's state with `num_tokens` committed tokens."""
    return {c.name: c.live_rows(num_tokens) * c.row_bytes for c in components}
