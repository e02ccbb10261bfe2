"""Model configuration: one frozen dataclass read from an HF-format `config.json`.

Two dialects load into it:
- Hugging Face Bamba (`model_type: "bamba"`): Mamba2 layers everywhere except
  `attn_layer_indices`, which are full attention; RoPE on half of each head.
- Hyrax's own (`model_type: "hyrax_hybrid"`): the same keys plus an explicit
  `layer_types` list whose entries are `full_attention`, `sliding_attention` or `mamba2`,
  and `sliding_window` (a query at position i sees keys j with i - j < sliding_window).
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError

LAYER_TYPES = ("full_attention", "sliding_attention", "mamba2")
ATTENTION_TYPES = ("full_attention", "sliding_attention")
# Bamba spells Mamba layers "linear_attention"; HF configs of other hybrids say "mamba".
_LAYER_ALIASES = {"linear_attention": "mamba2", "mamba": "mamba2", "attention": "full_attention"}


def _json_float(v) -> float:
    """Floats as transformers writes them, including {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    layer_types: tuple[str, ...]
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    mamba_n_heads: int = 0
    mamba_d_head: int = 0
    mamba_d_state: int = 0
    mamba_n_groups: int = 1
    mamba_d_conv: int = 4
    mamba_chunk_size: int = 64
    mamba_conv_bias: bool = True
    mamba_proj_bias: bool = False
    time_step_limit: tuple[float, float] = (0.0, float("inf"))
    sliding_window: int | None = None
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.5
    rms_norm_eps: float = 1e-5
    attention_bias: bool = False
    mlp_bias: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    pad_token_id: int | None = None
    model_type: str = "hyrax_hybrid"
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self):
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise HyraxInputError(
                    f"layer {i} has unknown layer type {t!r}; expected one of {', '.join(LAYER_TYPES)}"
                )
        if not self.layer_types:
            raise HyraxInputError("the model has no layers")
        if self.has_attention:
            if self.num_attention_heads % self.num_key_value_heads:
                raise HyraxInputError("num_attention_heads must be a multiple of num_key_value_heads")
        if "sliding_attention" in self.layer_types and not (self.sliding_window and self.sliding_window > 1):
            raise HyraxInputError("sliding_attention layers need sliding_window > 1 in config.json")
        if self.has_mamba:
            if self.mamba_n_heads % self.mamba_n_groups:
                raise HyraxInputError("mamba_n_heads must be a multiple of mamba_n_groups")
            if min(self.mamba_d_head, self.mamba_d_state, self.mamba_d_conv) < 1:
                raise HyraxInputError("mamba_d_head, mamba_d_state and mamba_d_conv must be positive")

    # ---- derived facts (computed here, used everywhere) -------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def has_attention(self) -> bool:
        return any(t in ATTENTION_TYPES for t in self.layer_types)

    @property
    def has_mamba(self) -> bool:
        return "mamba2" in self.layer_types

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def layers_of(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)

    # ---- HF dict round trip --------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise HyraxInputError("config.json must hold a JSON object")
        try:
            return cls._from_hf_dict(d)
        except KeyError as e:
            raise HyraxInputError(f"config.json is missing required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, HyraxInputError):
                raise
            raise HyraxInputError(f"config.json has an invalid value: {e}") from None

    @classmethod
    def _from_hf_dict(cls, d: dict) -> "ModelConfig":
        model_type = d.get("model_type", "hyrax_hybrid")
        n_layers = int(d["num_hidden_layers"])
        if "layer_types" in d and d["layer_types"] is not None:
            raw = list(d["layer_types"])
        elif "attn_layer_indices" in d:
            attn = set(d.get("attn_layer_indices") or [])
            raw = ["full_attention" if i in attn else "mamba2" for i in range(n_layers)]
        else:
            raise HyraxInputError("config.json needs `layer_types` or `attn_layer_indices`")
        layer_types = tuple(_LAYER_ALIASES.get(t, t) for t in raw)
        if len(layer_types) != n_layers:
            raise HyraxInputError(
                f"config.json lists {len(layer_types)} layer types for num_hidden_layers={n_layers}"
            )
        hidden = int(d["hidden_size"])
        n_heads = int(d.get("num_attention_heads", 1))
        kv_heads = d.get("num_key_value_heads")
        kv_heads = n_heads if kv_heads is None else int(kv_heads)
        if n_heads < 1 or kv_heads < 1:
            raise HyraxInputError("num_attention_heads and num_key_value_heads must be >= 1")
        head_dim = d.get("head_dim") or hidden // n_heads
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        if rope.get("rope_type", rope.get("type", "default")) not in ("default", None):
            raise HyraxInputError(f"unsupported rope type {rope.get('rope_type')!r} (only default RoPE)")
        partial = 0.5 if model_type == "bamba" else float(
            rope.get("partial_rotary_factor", d.get("partial_rotary_factor", 0.5))
        )
        expand = d.get("mamba_expand", 2)
        m_heads = int(d.get("mamba_n_heads", 0) or 0)
        m_head_dim = d.get("mamba_d_head", "auto")
        if m_head_dim in (None, "auto"):
            m_head_dim = expand * hidden // m_heads if m_heads else 0
        eos = d.get("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        tsl = [_json_float(v) for v in (d.get("time_step_limit") or (0.0, float("inf")))]
        if d.get("hidden_act", "silu") != "silu":
            raise HyraxInputError(f"unsupported hidden_act {d.get('hidden_act')!r} (only silu)")
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(
            vocab_size=int(d["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(d["intermediate_size"]),
            layer_types=layer_types,
            num_attention_heads=n_heads,
            num_key_value_heads=int(kv_heads),
            head_dim=int(head_dim),
            mamba_n_heads=m_heads,
            mamba_d_head=int(m_head_dim),
            mamba_d_state=int(d.get("mamba_d_state", 0) or 0),
            mamba_n_groups=int(d.get("mamba_n_groups", 1) or 1),
            mamba_d_conv=int(d.get("mamba_d_conv", 4)),
            mamba_chunk_size=int(d.get("mamba_chunk_size", 64)),
            mamba_conv_bias=bool(d.get("mamba_conv_bias", True)),
            mamba_proj_bias=bool(d.get("mamba_proj_bias", False)),
            time_step_limit=(float(tsl[0]), float(tsl[1])),
            sliding_window=d.get("sliding_window"),
            rope_theta=rope_theta,
            partial_rotary_factor=partial,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            attention_bias=bool(d.get("attention_bias", False)),
            mlp_bias=bool(d.get("mlp_bias", False)),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            pad_token_id=d.get("pad_token_id"),
            model_type=model_type,
            extra={k: v for k, v in d.items() if k not in known},
        )

    def to_hf_dict(self) -> dict:
        """A config.json for Hyrax's own dialect (Bamba keys + layer_types + sliding_window)."""
        return {
            "architectures": ["HyraxHybridForCausalLM"],
            "model_type": "hyrax_hybrid",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "mamba_n_heads": self.mamba_n_heads,
            "mamba_d_head": self.mamba_d_head,
            "mamba_d_state": self.mamba_d_state,
            "mamba_n_groups": self.mamba_n_groups,
            "mamba_d_conv": self.mamba_d_conv,
            "mamba_chunk_size": self.mamba_chunk_size,
            "mamba_conv_bias": self.mamba_conv_bias,
            "mamba_proj_bias": self.mamba_proj_bias,
            "time_step_limit": [lo if lo != float("inf") else {"__float__": "Infinity"} for lo in self.time_step_limit],
            "sliding_window": self.sliding_window,
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": self.attention_bias,
            "mlp_bias": self.mlp_bias,
            "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_id),
            "pad_token_id": self.pad_token_id,
            "hidden_act": "silu",
        }

    @classmethod
    def from_dir(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        if not p.is_dir():
            raise HyraxInputError(f"model path {str(p)!r} is not a directory")
        cfg = p / "config.json"
        if not cfg.is_file():
            raise HyraxInputError(f"{str(p)!r} has no config.json: not an HF-format checkpoint directory")
        try:
            d = json.loads(cfg.read_text())
        except json.JSONDecodeError as e:
            raise HyraxInputError(f"{cfg} is not valid JSON: {e}") from None
        return cls.from_hf_dict(d)
