"""Tensor-parallel shard arithmetic: which global heads/channels a rank holds.

Every function returns *global indices* along the sharded dimension, so that weight
loading, pool sizing and PD re-sharding (gather the global tensor from one TP layout,
slice it for another) all use one definition.
"""
from __future__ import annotations

from dataclasses import dataclass

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.errors import HyraxInputError


@dataclass(frozen=True)
class TP:
    rank: int = 0
    size: int = 1

    def __post_init__(self):
        if self.size < 1 or not 0 <= self.rank < self.size:
            raise HyraxInputError(f"invalid tensor-parallel rank {self.rank} of {self.size}")


def _split(n: int, tp: TP, what: str) -> range:
    if n % tp.size:
        raise HyraxInputError(f"{what}={n} is not divisible by tp_size={tp.size}")
    per = n // tp.size
    return range(tp.rank * per, (tp.rank + 1) * per)


def check_tp(cfg: ModelConfig, tp_size: int) -> None:
    """Raise a clear error if the model cannot be split `tp_size` ways."""
    kinds = set(cfg.ffn_kinds)
    for rank in range(tp_size):
        tp = TP(rank, tp_size)
        if cfg.has_attention:
            q_heads(cfg, tp)
            kv_heads(cfg, tp)
        if cfg.has_mamba:
            mamba_heads(cfg, tp)
            mamba_groups(cfg, tp)
        if cfg.layers_of("gated_deltanet"):
            gdn_k_heads(cfg, tp)
        if kinds & {"gated", "relu2"}:
            _split(cfg.intermediate_size, tp, "intermediate_size")
        if "moe" in kinds:
            _split(cfg.moe.intermediate_size, tp, "moe intermediate_size")
            _split(cfg.moe.shared_intermediate_size, tp, "shared expert intermediate_size")


def columns(n: int, tp: TP, what: str) -> range:
    """The contiguous slice of an n-wide intermediate dimension (MLP, expert) this rank holds."""
    return _split(n, tp, what)


def q_heads(cfg: ModelConfig, tp: TP) -> range:
    return _split(cfg.num_attention_heads, tp, "num_attention_heads")


def _split_or_replicate(n: int, tp: TP, what: str) -> range:
    """Split n items over the ranks when there are at least tp_size of them; otherwise each
    rank holds one item, shared by a block of tp_size / n consecutive ranks."""
    if n >= tp.size:
        return _split(n, tp, what)
    if tp.size % n:
        raise HyraxInputError(f"tp_size={tp.size} must be a multiple of {what}={n}")
    i = tp.rank // (tp.size // n)
    return range(i, i + 1)


def kv_heads(cfg: ModelConfig, tp: TP) -> range:
    """KV heads split when there are at least tp_size of them, else replicated in blocks."""
    return _split_or_replicate(cfg.num_key_value_heads, tp, "num_key_value_heads")


def mamba_heads(cfg: ModelConfig, tp: TP) -> range:
    return _split(cfg.mamba_n_heads, tp, "mamba_n_heads")


def mamba_groups(cfg: ModelConfig, tp: TP) -> range:
    """Groups split when there are at least tp_size of them, else the one group of this rank's heads."""
    return _split_or_replicate(cfg.mamba_n_groups, tp, "mamba_n_groups")


def mamba_inner_channels(cfg: ModelConfig, tp: TP) -> list[int]:
    """Channels of the (heads * head_dim) inner dimension held by this rank."""
    h = mamba_heads(cfg, tp)
    p = cfg.mamba_d_head
    return list(range(h.start * p, h.stop * p))


def mamba_group_channels(cfg: ModelConfig, tp: TP) -> list[int]:
    """Channels of one (n_groups * d_state) B or C block held by this rank."""
    g = mamba_groups(cfg, tp)
    n = cfg.mamba_d_state
    return list(range(g.start * n, g.stop * n))


def mamba_conv_channels(cfg: ModelConfig, tp: TP) -> list[int]:
    """Channels of the conv input `xBC = [x | B | C]` held by this rank (global indices)."""
    inner = cfg.mamba_intermediate
    gn = cfg.mamba_n_groups * cfg.mamba_d_state
    grp = mamba_group_channels(cfg, tp)
    return mamba_inner_channels(cfg, tp) + [inner + c for c in grp] + [inner + gn + c for c in grp]


def mamba_in_proj_rows(cfg: ModelConfig, tp: TP) -> list[int]:
    """Rows of in_proj, whose output is `[z | x | B | C | dt]`, held by this rank."""
    inner = cfg.mamba_intermediate
    conv = cfg.mamba_conv_dim
    h = mamba_heads(cfg, tp)
    z = mamba_inner_channels(cfg, tp)
    xbc = [inner + c for c in mamba_conv_channels(cfg, tp)]
    dt = [inner + conv + i for i in h]
    return z + xbc + dt


# ---- Gated DeltaNet: split by key heads, each with its num_v_heads / num_k_heads value heads ----

def gdn_k_heads(cfg: ModelConfig, tp: TP) -> range:
    return _split(cfg.gdn.num_k_heads, tp, "linear_num_key_heads")


def gdn_v_heads(cfg: ModelConfig, tp: TP) -> range:
    r = cfg.gdn.num_v_heads // cfg.gdn.num_k_heads
    k = gdn_k_heads(cfg, tp)
    return range(k.start * r, k.stop * r)


def gdn_conv_channels(cfg: ModelConfig, tp: TP) -> list[int]:
    """Channels of the conv input `[q | k | v]` held by this rank (global indices)."""
    g = cfg.gdn
    k, v = gdn_k_heads(cfg, tp), gdn_v_heads(cfg, tp)
    q_ch = list(range(k.start * g.k_head_dim, k.stop * g.k_head_dim))
    return (q_ch + [g.key_dim + c for c in q_ch]
            + [2 * g.key_dim + c for c in range(v.start * g.v_head_dim, v.stop * g.v_head_dim)])


def gdn_in_proj_rows(cfg: ModelConfig, tp: TP, per_head: int) -> list[int]:
    """Rows of a projection laid out in blocks of `per_head` rows per key head (in_proj_qkvz,
    in_proj_ba) held by this rank."""
    k = gdn_k_heads(cfg, tp)
    return list(range(k.start * per_head, k.stop * per_head))
