"""Model configuration: one frozen dataclass read from an HF-format `config.json`.

Each layer has a type (MIXERS: which mixers it runs: full or sliding-window attention,
Mamba2, Gated DeltaNet, attention + Mamba2 in parallel, or none) and a feed-forward kind
(FFN_TYPES). The families that load into it (Hyrax's own dialect, Bamba, NemotronH,
GraniteMoeHybrid, ...) are parsed in `families.py`, which refuses every config key it does
not use unless the key is documented there as not changing the computation.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError

# A layer's type names the mixers it runs before its feed-forward part.
MIXERS = {
    "full_attention": ("full_attention",),
    "sliding_attention": ("sliding_attention",),
    "mamba2": ("mamba2",),
    "attention_mamba2": ("full_attention", "mamba2"),  # Falcon-H1: both in parallel on one input
    "gated_deltanet": ("gated_deltanet",),  # Qwen3-Next linear attention
    "ffn_only": (),  # NemotronH "-" / "E" layers: no mixer, only the feed-forward part
}
LAYER_TYPES = tuple(MIXERS)
ATTENTION_TYPES = ("full_attention", "sliding_attention")
# gated: SwiGLU (gate/up/down); relu2: up -> relu^2 -> down (NemotronH); moe: routed experts
# plus shared expert(s) (MoeConfig); none: the layer has no feed-forward part.
FFN_TYPES = ("gated", "relu2", "moe", "none")
# How Mamba2 combines its scan output y with the gate z before out_proj:
# gate_then_norm: groupnorm(y * silu(z)) * w (Mamba2, Bamba, NemotronH, Granite);
# norm_then_gate: groupnorm(y) * w * silu(z); gate_only: y * silu(z), no norm weight
# (the last two: Falcon-H1 with mamba_norm_before_gate / without mamba_rms_norm).
MAMBA_NORMS = ("gate_then_norm", "norm_then_gate", "gate_only")
# Hyrax's own dialect accepts these spellings in `layer_types`.
_LAYER_ALIASES = {"linear_attention": "mamba2", "mamba": "mamba2", "attention": "full_attention"}


def _json_float(v) -> float:
    """Floats as transformers writes them, including {"__float__": "Infinity"}."""
    if isinstance(v, dict) and "__float__" in v:
        return float(v["__float__"])
    return float(v)


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts (+ shared experts) of a `moe` feed-forward layer.

    router: `topk_softmax` (Granite: softmax over the top-k logits), `softmax_topk` (Qwen:
    softmax over all experts, top-k, optionally renormalised), `sigmoid_grouped` (NemotronH /
    DeepSeek-V3: sigmoid scores + correction bias, group-limited top-k, optional renormalisation,
    times `routed_scaling_factor`).
    """

    num_experts: int
    top_k: int
    intermediate_size: int
    shared_intermediate_size: int  # 0: no shared expert
    router: str
    gated_experts: bool = True  # SwiGLU experts; False: relu2 up/down experts (NemotronH)
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0
    n_group: int = 1
    topk_group: int = 1
    shared_expert_gate: bool = False  # Qwen: shared expert output times sigmoid(gate(x))
    shared_expert_bias: bool = False  # biases on the shared expert's projections (NemotronH: mlp_bias)

    def __post_init__(self):
        if self.router not in ("topk_softmax", "softmax_topk", "sigmoid_grouped"):
            raise HyraxInputError(f"unknown MoE router {self.router!r}")
        if self.num_experts and not 0 < self.top_k <= self.num_experts:
            raise HyraxInputError(f"num_experts_per_tok={self.top_k} must be in 1..{self.num_experts}")
        if self.num_experts % self.n_group or not 0 < self.topk_group <= self.n_group:
            raise HyraxInputError("n_group must divide the expert count and topk_group must be in 1..n_group")


@dataclass(frozen=True)
class Multipliers:
    """Falcon-H1's µP scalars, applied where its layers compute (1.0: no-op).

    attention_in / ssm_in scale the normalised input of the attention / Mamba2 mixer,
    attention_out / ssm_out their outputs; key scales K after k_proj; ssm_sections scale the
    five parts [z | x | B | C | dt] of Mamba2's in_proj output; mlp_gate scales the gate
    projection before its activation and mlp_down the MLP output.
    """

    attention_in: float = 1.0
    attention_out: float = 1.0
    key: float = 1.0
    ssm_in: float = 1.0
    ssm_out: float = 1.0
    ssm_sections: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    mlp_gate: float = 1.0
    mlp_down: float = 1.0

    def __post_init__(self):
        if len(self.ssm_sections) != 5:
            raise HyraxInputError("ssm_multipliers must list 5 values (z, x, B, C, dt)")

    def mixer_scales(self, mixer: str) -> tuple[float, float]:
        """(input, output) multipliers of one mixer kind inside a layer."""
        if mixer == "mamba2":
            return self.ssm_in, self.ssm_out
        if mixer in ATTENTION_TYPES:
            return self.attention_in, self.attention_out
        return 1.0, 1.0


@dataclass(frozen=True)
class GdnConfig:
    """Gated DeltaNet (Qwen3-Next linear attention) dimensions."""

    num_k_heads: int
    num_v_heads: int
    k_head_dim: int
    v_head_dim: int
    conv_kernel: int

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.k_head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.v_head_dim

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim


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
    mamba_out_proj_bias: bool | None = None  # None: as mamba_proj_bias (Falcon-H1: projectors_bias)
    mamba_norm: str = "gate_then_norm"  # MAMBA_NORMS
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
    # per-layer feed-forward kind (FFN_TYPES); () means "gated" in every layer
    ffn_types: tuple[str, ...] = ()
    hidden_act: str = "silu"  # activation of gated MLPs / experts
    moe: MoeConfig | None = None
    gdn: GdnConfig | None = None
    # scalars some families fold into the forward pass (1.0 / None: no-op)
    embedding_multiplier: float = 1.0  # embeddings are multiplied by it
    residual_multiplier: float = 1.0  # each block's output is multiplied by it before the residual add
    attention_scale: float | None = None  # softmax scale; None: head_dim ** -0.5
    logits_multiplier: float = 1.0  # final logits are multiplied by it
    use_rope: bool = True  # False: attention without positions (NoPE)
    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight) (Qwen3-Next: 1)
    attn_output_gate: bool = False  # q_proj also yields a per-channel gate: out * sigmoid(gate)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE
    mup: Multipliers = Multipliers()  # Falcon-H1's per-mixer / MLP multipliers

    def __post_init__(self):
        for i, t in enumerate(self.layer_types):
            if t not in LAYER_TYPES:
                raise HyraxInputError(
                    f"layer {i} has unknown layer type {t!r}; expected one of {', '.join(LAYER_TYPES)}"
                )
        if not self.layer_types:
            raise HyraxInputError("the model has no layers")
        if self.ffn_types and len(self.ffn_types) != len(self.layer_types):
            raise HyraxInputError("ffn_types must list one entry per layer")
        for i, t in enumerate(self.ffn_types):
            if t not in FFN_TYPES:
                raise HyraxInputError(f"layer {i} has unknown feed-forward type {t!r}")
        if "moe" in self.ffn_kinds and self.moe is None:
            raise HyraxInputError("moe layers need an MoE configuration")
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
            if self.mamba_norm not in MAMBA_NORMS:
                raise HyraxInputError(f"unknown Mamba2 norm {self.mamba_norm!r}")
        if self.layers_of("gated_deltanet"):
            g = self.gdn
            if g is None or min(g.num_k_heads, g.num_v_heads, g.k_head_dim, g.v_head_dim, g.conv_kernel) < 1:
                raise HyraxInputError("gated_deltanet layers need positive linear_* head counts and dimensions")
            if g.num_v_heads % g.num_k_heads:
                raise HyraxInputError("linear_num_value_heads must be a multiple of linear_num_key_heads")

    # ---- derived facts (computed here, used everywhere) -------------------------------
    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def ffn_kinds(self) -> tuple[str, ...]:
        return self.ffn_types or ("gated",) * len(self.layer_types)

    @property
    def has_attention(self) -> bool:
        return any(self.layers_of(t) for t in ATTENTION_TYPES)

    @property
    def has_mamba(self) -> bool:
        return bool(self.layers_of("mamba2"))

    @property
    def mamba_intermediate(self) -> int:
        return self.mamba_n_heads * self.mamba_d_head

    @property
    def mamba_conv_dim(self) -> int:
        return self.mamba_intermediate + 2 * self.mamba_n_groups * self.mamba_d_state

    @property
    def mamba_out_bias(self) -> bool:
        return self.mamba_proj_bias if self.mamba_out_proj_bias is None else self.mamba_out_proj_bias

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor) if self.use_rope else 0

    @property
    def softmax_scale(self) -> float:
        return self.head_dim ** -0.5 if self.attention_scale is None else self.attention_scale

    def layers_of(self, mixer: str) -> tuple[int, ...]:
        """Layers that run `mixer` (a layer type of MIXERS' values: full_attention, mamba2, ...)."""
        return tuple(i for i, t in enumerate(self.layer_types) if mixer in MIXERS[t])

    # ---- HF dict round trip --------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict) -> "ModelConfig":
        if not isinstance(d, dict):
            raise HyraxInputError("config.json must hold a JSON object")
        from hyrax.actors.model.families import parse_config

        try:
            return parse_config(d)
        except KeyError as e:
            raise HyraxInputError(f"config.json is missing required key {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:
            if isinstance(e, HyraxInputError):
                raise
            raise HyraxInputError(f"config.json has an invalid value: {e}") from None

    def to_hf_dict(self) -> dict:
        """A config.json for Hyrax's own dialect (Bamba keys + layer_types + sliding_window).
        ValueError naming the fields when this config sets one the dialect has no key for
        (another family's multipliers, norms, feed-forward kinds): written without it, the
        file would load as another model."""
        d = self._dialect_dict()
        back = dataclasses.replace(ModelConfig.from_hf_dict(d), model_type=self.model_type)
        lost = [f.name for f in dataclasses.fields(self) if getattr(back, f.name) != getattr(self, f.name)]
        if lost:
            raise ValueError(f"Hyrax's config dialect cannot describe {', '.join(lost)} of this "
                             f"{self.model_type} model")
        return d

    def _dialect_dict(self) -> dict:
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
        config = cls.from_hf_dict(d)
        gen = p / "generation_config.json"
        if gen.is_file():  # generation stops at every EOS id either file names (as generate does)
            try:
                eos = json.loads(gen.read_text()).get("eos_token_id")
            except (json.JSONDecodeError, AttributeError):
                raise HyraxInputError(f"{gen} is not a valid JSON object") from None
            extra = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
            merged = tuple(dict.fromkeys([*config.eos_token_id, *(int(e) for e in extra)]))
            config = dataclasses.replace(config, eos_token_id=merged)
        return config
