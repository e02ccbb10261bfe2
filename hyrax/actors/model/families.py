"""Checkpoint families: how each `model_type`'s config.json becomes a ModelConfig, and how
its weight names map onto Hyrax's module tree.

Every key of config.json is either read by the family's parser or listed in `INERT_KEYS`
(keys that do not change what the model computes: training-only settings, initialisation
ranges, bookkeeping). Any other key is refused with a one-line error naming it, and so is a
value Hyrax does not implement (an activation, a RoPE scaling type, a quantization config).
A checkpoint that loads therefore computes what its authors' code computes.

Hyrax's module tree (the names `weight_namer` maps onto):
    model.embed_tokens, model.final_layernorm, lm_head
    model.layers.{i}.input_layernorm      norm before the mixer(s)
    model.layers.{i}.mamba / self_attn / linear_attn   the mixers (Mamba2, attention, Gated DeltaNet)
    model.layers.{i}.pre_ff_layernorm     norm before the feed-forward part
    model.layers.{i}.feed_forward         GatedMLP (gate/up/down_proj), ReluSqMLP (up/down_proj) or
                                          MoE (router, experts, shared_expert, shared_expert_gate)
"""
from __future__ import annotations

import re
from typing import Callable

from hyrax.actors.model.config import GdnConfig, ModelConfig, MoeConfig, Multipliers, _json_float, _LAYER_ALIASES
from hyrax.actors.model.errors import HyraxInputError

# Keys that never change the forward computation, for every family.
INERT_KEYS = frozenset({
    "architectures", "transformers_version", "dtype", "torch_dtype", "_name_or_path", "use_cache",
    "initializer_range", "attention_dropout", "hidden_dropout", "output_router_logits", "router_aux_loss_coef",
    "num_logits_to_keep", "use_mamba_kernels", "z_loss_coefficient",
    # Mamba2 initialisation ranges (only the init of dt_bias reads them; dt is clamped to
    # time_step_limit, in every family) ...
    "time_step_min", "time_step_max", "time_step_floor", "rescale_prenorm_residual",
    # ... and generation/tokenizer hints that the tokenizer files carry too
    "tokenizer_class", "auto_map",
})
# Mamba state precision: Hyrax always keeps SSM state in float32 (float64 for float64 models).
_SSM_CACHE_DTYPES = ("float32",)
ACTIVATIONS = ("silu",)


class Keys:
    """config.json with use tracking: every key read is marked used; `finish` refuses the rest."""

    def __init__(self, d: dict, model_type: str):
        self.d, self.model_type, self.used = d, model_type, set(INERT_KEYS)

    def get(self, key: str, default=None):
        self.used.add(key)
        v = self.d.get(key)
        return default if v is None else v

    def req(self, key: str):
        self.used.add(key)
        if self.d.get(key) is None:
            raise HyraxInputError(f"config.json is missing required key {key!r}")
        return self.d[key]

    def choice(self, key: str, allowed: tuple, default=None):
        v = self.get(key, default)
        if v not in allowed:
            raise HyraxInputError(f"config.json key {key!r} = {v!r} is not supported by Hyrax "
                                  f"(supported: {', '.join(map(repr, allowed))})")
        return v

    def finish(self) -> None:
        if "quantization_config" in self.d:
            raise HyraxInputError("config.json key 'quantization_config': quantized checkpoints are not supported")
        for k in self.d:
            if k not in self.used:
                raise HyraxInputError(f"config.json key {k!r} is not supported for model_type "
                                      f"{self.model_type!r}: Hyrax would ignore it and compute something else")


def _eos(v) -> tuple[int, ...]:
    if v is None:
        return ()
    return tuple(int(x) for x in v) if isinstance(v, (list, tuple)) else (int(v),)


def _rope(k: Keys, default_partial: float | None, top_level_partial: bool = True) -> dict:
    """rope_theta and partial_rotary_factor from `rope_parameters` / `rope_scaling` / top level.
    `default_partial` None: the family rotates whole heads (transformers' Granite and Falcon-H1
    ignore the factor), so a factor other than 1 is refused rather than honoured or dropped.
    Without `top_level_partial` only `rope_parameters` may change the factor (transformers'
    Bamba overrides a top-level one with its default), so a top-level value other than the
    default is refused."""
    rope = k.get("rope_parameters") or k.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise HyraxInputError("config.json key 'rope_parameters' must be an object")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", None):
        raise HyraxInputError(f"config.json rope type {kind!r} is not supported (only default RoPE)")
    extra = set(rope) - {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
    if extra:
        raise HyraxInputError(f"config.json rope parameter {sorted(extra)[0]!r} is not supported")
    default = 1.0 if default_partial is None else default_partial
    top = k.get("partial_rotary_factor")
    if top is not None and not top_level_partial and float(top) != default:
        raise HyraxInputError(f"config.json key 'partial_rotary_factor' = {top} is not supported for model_type "
                              f"{k.model_type!r}: transformers uses {default} unless rope_parameters sets it")
    partial = float(rope.get("partial_rotary_factor", default if top is None else top))
    if default_partial is None and partial != 1.0:
        raise HyraxInputError(f"config.json key 'partial_rotary_factor' = {partial} is not supported for model_type "
                              f"{k.model_type!r}: its attention rotates whole heads")
    return dict(rope_theta=float(rope.get("rope_theta", k.get("rope_theta", 10000.0))), partial_rotary_factor=partial)


def _common(k: Keys, n_layers: int) -> dict:
    """Keys every family spells the same way."""
    hidden = int(k.req("hidden_size"))
    n_heads = int(k.get("num_attention_heads", 1))
    kv = int(k.get("num_key_value_heads", n_heads))
    if n_heads < 1 or kv < 1:
        raise HyraxInputError("num_attention_heads and num_key_value_heads must be >= 1")
    return dict(
        vocab_size=int(k.req("vocab_size")), hidden_size=hidden,
        num_attention_heads=n_heads, num_key_value_heads=kv,
        head_dim=int(k.get("head_dim", hidden // n_heads)),
        tie_word_embeddings=bool(k.get("tie_word_embeddings", False)),
        max_position_embeddings=int(k.get("max_position_embeddings", 4096)),
        bos_token_id=k.get("bos_token_id"), eos_token_id=_eos(k.get("eos_token_id")),
        pad_token_id=k.get("pad_token_id"),
        attention_bias=bool(k.get("attention_bias", False)), mlp_bias=bool(k.get("mlp_bias", False)),
        sliding_window=k.get("sliding_window"),
    )


def _time_step_limit(k: Keys, key: str = "time_step_limit") -> tuple[float, float]:
    v = [_json_float(x) for x in k.get(key, (0.0, float("inf")))]
    return float(v[0]), float(v[1])


def _bamba_mamba(k: Keys, hidden: int) -> dict:
    """Mamba2 keys in Bamba's spelling (Bamba, GraniteMoeHybrid, Hyrax)."""
    heads = int(k.get("mamba_n_heads", 0))
    expand = k.get("mamba_expand")
    d_head = k.get("mamba_d_head", "auto")
    if d_head == "auto":
        d_head = int(expand or 2) * hidden // heads if heads else 0
    if heads and expand is not None and int(expand) * hidden != heads * int(d_head):
        raise HyraxInputError(f"config.json: mamba_expand * hidden_size = {int(expand) * hidden} does not equal "
                              f"mamba_n_heads * mamba_d_head = {heads * int(d_head)}")
    return dict(
        mamba_n_heads=heads, mamba_d_head=int(d_head),
        mamba_d_state=int(k.get("mamba_d_state", 0)), mamba_n_groups=int(k.get("mamba_n_groups", 1)),
        mamba_d_conv=int(k.get("mamba_d_conv", 4)), mamba_chunk_size=int(k.get("mamba_chunk_size", 64)),
        mamba_conv_bias=bool(k.get("mamba_conv_bias", True)), mamba_proj_bias=bool(k.get("mamba_proj_bias", False)),
        time_step_limit=_time_step_limit(k),
    )


def _layer_count(k: Keys, types: list) -> int:
    n = k.get("num_hidden_layers")
    if n is not None and int(n) != len(types):
        raise HyraxInputError(f"config.json lists {len(types)} layer types for num_hidden_layers={n}")
    return len(types)


# ---- families ------------------------------------------------------------------------------

def _hyrax_or_bamba(k: Keys, model_type: str) -> ModelConfig:
    n = int(k.req("num_hidden_layers"))
    if model_type == "bamba" and k.get("layer_types") is not None:
        raise HyraxInputError("config.json key 'layer_types' is not supported for model_type 'bamba': "
                              "its layers come from attn_layer_indices")
    if k.get("layer_types") is not None:
        types = [_LAYER_ALIASES.get(t, t) for t in k.get("layer_types")]
    elif "attn_layer_indices" in k.d:
        attn = set(k.get("attn_layer_indices", []))
        types = ["full_attention" if i in attn else "mamba2" for i in range(n)]
    else:
        raise HyraxInputError("config.json needs `layer_types` or `attn_layer_indices`")
    _layer_count(k, types)
    k.choice("hidden_act", ACTIVATIONS, "silu")
    common = _common(k, n)  # head_dim: BambaConfig has no such argument, but its attention reads one present
    return ModelConfig(
        **common, intermediate_size=int(k.req("intermediate_size")), layer_types=tuple(types),
        **_bamba_mamba(k, common["hidden_size"]), **_rope(k, 0.5, top_level_partial=model_type != "bamba"),
        rms_norm_eps=float(k.get("rms_norm_eps", 1e-5)), model_type=model_type,
    )


def _granite(k: Keys) -> ModelConfig:
    raw = k.get("layer_types") or k.get("layers_block_type")
    if raw is None:
        raise HyraxInputError("config.json needs `layer_types`")
    alias = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "full_attention",
             "attention": "full_attention"}
    for t in raw:
        if t not in alias:
            raise HyraxInputError(f"config.json: unknown GraniteMoeHybrid layer type {t!r} (Mamba2 or full attention)")
    types = [alias[t] for t in raw]
    n = _layer_count(k, types)
    act = k.choice("hidden_act", ACTIVATIONS, "silu")
    pos = k.choice("position_embedding_type", (None, "nope", "rope"), None)
    k.choice("normalization_function", ("rmsnorm",), "rmsnorm")  # IBM's spelling of what Granite computes
    common = _common(k, n)
    experts = int(k.get("num_local_experts", 0))
    top_k = int(k.get("num_experts_per_tok", 2))  # transformers' default; unused without routed experts
    moe = MoeConfig(
        num_experts=experts, top_k=top_k if experts else 0,
        intermediate_size=int(k.req("intermediate_size")),
        shared_intermediate_size=int(k.req("shared_intermediate_size")), router="topk_softmax",
    )
    return ModelConfig(
        **common, intermediate_size=moe.intermediate_size, layer_types=tuple(types),
        ffn_types=("moe",) * n, moe=moe, hidden_act=act,
        **_bamba_mamba(k, common["hidden_size"]), **_rope(k, None), use_rope=pos == "rope",
        rms_norm_eps=float(k.get("rms_norm_eps", 1e-6)), model_type="granitemoehybrid",
        embedding_multiplier=float(k.get("embedding_multiplier", 1.0)),
        residual_multiplier=float(k.get("residual_multiplier", 1.0)),
        attention_scale=float(k.get("attention_multiplier", 1.0)),
        logits_multiplier=1.0 / float(k.get("logits_scaling", 1.0)),
    )


_NEMOTRON_PATTERN = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}


def _nemotron_h(k: Keys) -> ModelConfig:
    raw = k.get("layers_block_type") or k.get("layer_types")
    pattern = k.get("hybrid_override_pattern")
    if raw is None and pattern is not None:
        bad = sorted(set(pattern) - set(_NEMOTRON_PATTERN))
        if bad:
            raise HyraxInputError(f"config.json hybrid_override_pattern has unknown layer symbol {bad[0]!r}")
        raw = [_NEMOTRON_PATTERN[c] for c in pattern]
    if raw is None:
        raise HyraxInputError("config.json needs `layers_block_type` or `hybrid_override_pattern`")
    mixers = {"linear_attention": "mamba2", "mamba": "mamba2", "full_attention": "full_attention",
              "attention": "full_attention", "mlp": "ffn_only", "moe": "ffn_only"}
    ffns = {"mlp": "relu2", "moe": "moe"}
    for t in raw:
        if t not in mixers:
            raise HyraxInputError(f"config.json: unknown NemotronH layer type {t!r}")
    n = _layer_count(k, raw)
    k.choice("mlp_hidden_act", ("relu2",), "relu2")
    k.choice("sliding_window", (None,), None)  # NemotronH attention is always full
    k.choice("mamba_hidden_act", ACTIVATIONS, "silu")
    k.choice("mamba_ssm_cache_dtype", _SSM_CACHE_DTYPES, "float32")
    k.choice("residual_in_fp32", (False,), False)  # True would keep residuals in float32
    k.choice("moe_latent_size", (None,), None)
    k.choice("num_nextn_predict_layers", (0,), 0)  # MTP layers (speculative) are not served
    k.get("mtp_layers_block_type")  # describes the MTP layers only
    k.get("mtp_hybrid_override_pattern")
    k.get("n_shared_experts")  # exactly one shared MLP (moe_shared_expert_intermediate_size)
    k.get("moe_shared_expert_overlap")  # a scheduling hint for fused kernels
    k.get("expand")  # the Mamba width is mamba_num_heads * mamba_head_dim
    k.get("mamba_proj_bias")  # NemotronH's Mamba projections follow use_bias
    common = _common(k, n)
    common["tie_word_embeddings"] = False  # transformers' NemotronH never ties its LM head
    moe = None
    if "moe" in raw:
        moe = MoeConfig(
            num_experts=int(k.req("n_routed_experts")), top_k=int(k.req("num_experts_per_tok")),
            intermediate_size=int(k.req("moe_intermediate_size")),
            shared_intermediate_size=int(k.req("moe_shared_expert_intermediate_size")),
            router="sigmoid_grouped", gated_experts=False, norm_topk_prob=bool(k.get("norm_topk_prob", True)),
            routed_scaling_factor=float(k.get("routed_scaling_factor", 1.0)),
            n_group=int(k.get("n_group", 1)), topk_group=int(k.get("topk_group", 1)),
            shared_expert_bias=common["mlp_bias"],
        )
    else:
        for key in ("n_routed_experts", "num_experts_per_tok", "moe_intermediate_size",
                    "moe_shared_expert_intermediate_size", "norm_topk_prob", "routed_scaling_factor",
                    "n_group", "topk_group"):
            k.get(key)  # no moe layer reads them
    bias = bool(k.get("use_bias", False))
    return ModelConfig(
        **common, intermediate_size=int(k.get("intermediate_size", 1)),
        layer_types=tuple(mixers[t] for t in raw), ffn_types=tuple(ffns.get(t, "none") for t in raw), moe=moe,
        mamba_n_heads=int(k.get("mamba_num_heads", 0)), mamba_d_head=int(k.get("mamba_head_dim", 0)),
        mamba_d_state=int(k.get("ssm_state_size", 0)), mamba_n_groups=int(k.get("n_groups", 1)),
        mamba_d_conv=int(k.get("conv_kernel", 4)), mamba_chunk_size=int(k.get("chunk_size", 128)),
        mamba_conv_bias=bool(k.get("use_conv_bias", True)), mamba_proj_bias=bias,
        time_step_limit=_time_step_limit(k), use_rope=False, partial_rotary_factor=0.0,
        rms_norm_eps=float(k.get("layer_norm_epsilon", 1e-5)), model_type="nemotron_h",
    )


def _qwen3_next(k: Keys) -> ModelConfig:
    raw = k.get("layer_types")
    interval = int(k.get("full_attention_interval", 4))  # transformers reads it only without layer_types
    if raw is None:
        if interval < 1:
            raise HyraxInputError(f"config.json key 'full_attention_interval' = {interval} must be >= 1")
        raw = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
               for i in range(int(k.req("num_hidden_layers")))]
    mixers = {"linear_attention": "gated_deltanet", "full_attention": "full_attention"}
    for t in raw:
        if t not in mixers:
            raise HyraxInputError(f"config.json: unknown Qwen3-Next layer type {t!r}")
    n = _layer_count(k, raw)
    act = k.choice("hidden_act", ACTIVATIONS, "silu")
    k.choice("sliding_window", (None,), None)
    k.choice("use_sliding_window", (False,), False)
    common = _common(k, n)
    experts = int(k.get("num_experts", 0))
    dense = set(k.get("mlp_only_layers", []))
    step = int(k.get("decoder_sparse_step", 1))
    ffn = tuple("moe" if experts and i not in dense and (i + 1) % step == 0 else "gated" for i in range(n))
    routing = dict(  # read even when no layer routes (num_experts 0): Qwen3NextConfig writes them all
        num_experts=experts, top_k=int(k.get("num_experts_per_tok", 10)),  # absent: transformers' defaults
        intermediate_size=int(k.get("moe_intermediate_size", 1)),
        shared_intermediate_size=int(k.get("shared_expert_intermediate_size", 0)),
        norm_topk_prob=bool(k.get("norm_topk_prob", True)),
    )
    moe = MoeConfig(**routing, router="softmax_topk", shared_expert_gate=True) if "moe" in ffn else None
    gdn = GdnConfig(
        num_k_heads=int(k.req("linear_num_key_heads")), num_v_heads=int(k.req("linear_num_value_heads")),
        k_head_dim=int(k.req("linear_key_head_dim")), v_head_dim=int(k.req("linear_value_head_dim")),
        conv_kernel=int(k.get("linear_conv_kernel_dim", 4)),
    )
    return ModelConfig(
        **common, intermediate_size=int(k.req("intermediate_size")),
        layer_types=tuple(mixers[t] for t in raw), ffn_types=ffn, moe=moe, gdn=gdn, hidden_act=act,
        **_rope(k, 0.25), rms_norm_eps=float(k.get("rms_norm_eps", 1e-6)), model_type="qwen3_next",
        norm_offset=1.0, attn_output_gate=True, qk_norm=True,
    )


def _falcon_h1(k: Keys) -> ModelConfig:
    """Falcon-H1: every layer runs attention (full RoPE, K scaled) and Mamba2 in parallel on one
    normalised input, then a SwiGLU MLP; µP multipliers everywhere (`Multipliers`)."""
    n = int(k.req("num_hidden_layers"))
    k.choice("hidden_act", ACTIVATIONS, "silu")  # the MLP's and the Mamba conv's activation
    k.choice("attn_layer_indices", (None,), None)  # attention runs in every layer
    k.choice("mamba_use_mlp", (True,), True)  # every layer has its MLP
    k.get("mlp_expansion_factor")  # intermediate_size is the MLP width
    k.choice("sliding_window", (None,), None)  # Falcon-H1 attention is always full
    common = _common(k, n)
    hidden = common["hidden_size"]
    heads = int(k.req("mamba_n_heads"))
    expand = int(k.get("mamba_expand", 2))  # sets the Mamba width only when mamba_d_ssm is absent
    inner = k.get("mamba_d_ssm")
    inner = int(inner) if inner is not None else expand * hidden
    d_head = k.get("mamba_d_head", "auto")
    d_head = inner // heads if d_head == "auto" else int(d_head)
    if heads * d_head != inner:
        raise HyraxInputError(f"config.json: mamba_n_heads * mamba_d_head = {heads * d_head} does not equal the "
                              f"Mamba width {inner} (mamba_d_ssm, or mamba_expand * hidden_size)")
    rms_norm = bool(k.get("mamba_rms_norm", False))
    before_gate = bool(k.get("mamba_norm_before_gate", True))  # only read with mamba_rms_norm
    gate, down = (_json_float(v) for v in k.get("mlp_multipliers", (1.0, 1.0)))
    sections = tuple(_json_float(v) for v in k.get("ssm_multipliers", (1.0,) * 5))
    if len(sections) != 5:
        raise HyraxInputError(f"config.json key 'ssm_multipliers' must list 5 values, got {len(sections)}")
    mup = Multipliers(
        attention_in=float(k.get("attention_in_multiplier", 1.0)),
        attention_out=float(k.get("attention_out_multiplier", 1.0)),
        key=float(k.get("key_multiplier", 1.0)),
        ssm_in=float(k.get("ssm_in_multiplier", 1.0)), ssm_out=float(k.get("ssm_out_multiplier", 1.0)),
        ssm_sections=sections, mlp_gate=gate, mlp_down=down,
    )
    return ModelConfig(
        **common, intermediate_size=int(k.req("intermediate_size")), layer_types=("attention_mamba2",) * n,
        mamba_n_heads=heads, mamba_d_head=d_head, mamba_d_state=int(k.req("mamba_d_state")),
        mamba_n_groups=int(k.get("mamba_n_groups", 1)), mamba_d_conv=int(k.get("mamba_d_conv", 4)),
        mamba_chunk_size=int(k.get("mamba_chunk_size", 256)), mamba_conv_bias=bool(k.get("mamba_conv_bias", True)),
        mamba_proj_bias=bool(k.get("mamba_proj_bias", False)),
        mamba_out_proj_bias=bool(k.get("projectors_bias", False)),
        mamba_norm=("norm_then_gate" if before_gate else "gate_then_norm") if rms_norm else "gate_only",
        time_step_limit=_time_step_limit(k), **_rope(k, None),
        rms_norm_eps=float(k.get("rms_norm_eps", 1e-5)), model_type="falcon_h1",
        embedding_multiplier=float(k.get("embedding_multiplier", 1.0)),
        logits_multiplier=float(k.get("lm_head_multiplier", 1.0)), mup=mup,
    )


_PARSERS: dict[str, Callable[[Keys], ModelConfig]] = {
    "hyrax_hybrid": lambda k: _hyrax_or_bamba(k, "hyrax_hybrid"),
    "bamba": lambda k: _hyrax_or_bamba(k, "bamba"),
    "granitemoehybrid": _granite,
    "nemotron_h": _nemotron_h,
    "qwen3_next": _qwen3_next,
    "falcon_h1": _falcon_h1,
}


def parse_config(d: dict) -> ModelConfig:
    model_type = d.get("model_type", "hyrax_hybrid")
    if model_type not in _PARSERS:
        raise HyraxInputError(f"config.json model_type {model_type!r} is not supported "
                              f"(supported: {', '.join(sorted(_PARSERS))})")
    k = Keys(d, model_type)
    k.get("model_type")
    cfg = _PARSERS[model_type](k)
    k.finish()
    return cfg


# ---- weight names ----------------------------------------------------------------------------

Rule = tuple[str, str]
# checkpoint entries that are not weights of the served model (rotary caches, MTP heads)
_SKIP = re.compile(r"(^|\.)rotary_emb\.inv_freq$|^mtp\.")

_GRANITE: list[Rule] = [
    (r"^model\.norm\.", "model.final_layernorm."),
    (r"\.post_attention_layernorm\.", ".pre_ff_layernorm."),
    (r"\.block_sparse_moe\.router\.layer\.weight$", ".feed_forward.router.weight"),
    (r"\.block_sparse_moe\.(input|output)_linear\.weight$", r".feed_forward.experts.\1_linear"),
    (r"\.shared_mlp\.", ".feed_forward.shared_expert."),
]
_NEMOTRON: list[Rule] = [
    (r"^(backbone|model)\.embeddings\.", "model.embed_tokens."),
    (r"^(backbone|model)\.norm_f\.", "model.final_layernorm."),
    (r"^(backbone|model)\.layers\.", "model.layers."),
    (r"\.mixer\.gate\.", ".feed_forward.router."),
    (r"\.mixer\.shared_experts\.", ".feed_forward.shared_expert."),
]


_QWEN3_NEXT: list[Rule] = [
    (r"^model\.norm\.", "model.final_layernorm."),
    (r"\.post_attention_layernorm\.", ".pre_ff_layernorm."),
    (r"\.mlp\.gate\.weight$", ".feed_forward.router.weight"),
    (r"\.mlp\.", ".feed_forward."),
]


def _apply(rules: list[Rule], name: str) -> str:
    for pat, rep in rules:
        name = re.sub(pat, rep, name)
    return name


def weight_namer(cfg: ModelConfig) -> Callable[[str], str | None]:
    """checkpoint weight name -> Hyrax parameter name (None: not part of the served model)."""
    family = cfg.model_type

    def name_of(ckpt: str) -> str | None:
        if _SKIP.search(ckpt):
            return None
        if family == "granitemoehybrid":
            return _apply(_GRANITE, ckpt)
        if family == "qwen3_next":
            return _apply(_QWEN3_NEXT, ckpt)
        if family == "nemotron_h":
            name = _apply(_NEMOTRON, ckpt)
            m = re.match(r"model\.layers\.(\d+)\.(norm|mixer)\.(.*)$", name)
            if m:
                i, part, rest = int(m.group(1)), m.group(2), m.group(3)
                ltype = cfg.layer_types[i] if i < cfg.num_layers else "ffn_only"
                if part == "norm":
                    where = "pre_ff_layernorm" if ltype == "ffn_only" else "input_layernorm"
                else:
                    where = {"mamba2": "mamba", "full_attention": "self_attn"}.get(ltype, "feed_forward")
                name = f"model.layers.{i}.{where}.{rest}"
            return name
        return ckpt

    return name_of
