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

Each layer module declares the components it keeps (`state_components(cfg, tp, dtype)` in
attention.py, mamba2.py, gated_deltanet.py; the spec itself is in components.py) and reads its
pools by the names it declared; this module joins the declarations into the model's table. A new
recurrent layer type declares its components in its own module and is added to `DECLARATIONS`,
and nowhere else in the state machinery: its components are ordinary `slot` components, so
backup, restore, checksums, transfer, migration and re-sharding handle them with no special case.
"""
from __future__ import annotations

import torch

from hyrax.actors.model import attention, gated_deltanet, mamba2
from hyrax.actors.model.components import KINDS, SLOT, TOKEN, WINDOW, ComponentSpec
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.sharding import TP

__all__ = ["KINDS", "SLOT", "TOKEN", "WINDOW", "ComponentSpec", "derive_components", "has_recurrent_state",
           "component_by_name", "bytes_formula"]

# Each layer type's module declares the components it keeps, in the order of this table.
DECLARATIONS = (attention.state_components, mamba2.state_components, gated_deltanet.state_components)


def derive_components(cfg: ModelConfig, tp: TP = TP(), dtype: torch.dtype = torch.float32) -> tuple[ComponentSpec, ...]:
    """The ordered component list of a model shard: every layer module's declaration, joined."""
    return tuple(c for declare in DECLARATIONS for c in declare(cfg, tp, dtype))


# ---- predicates: one definition each, used by startup validation and runtime alike ----------

def has_recurrent_state(components: tuple[ComponentSpec, ...]) -> bool:
    """True when some component is a per-request slot (state that cannot be recomputed per token)."""
    return any(c.kind == SLOT for c in components)


def component_by_name(components: tuple[ComponentSpec, ...]) -> dict[str, ComponentSpec]:
    return {c.name: c for c in components}


def bytes_formula(components: tuple[ComponentSpec, ...], num_tokens: int) -> dict[str, int]:
    """Exact bytes of one rank's share of a request's state with `num_tokens` committed tokens."""
    return {c.name: c.live_rows(num_tokens) * c.row_bytes for c in components}
