"""The hybrid decoder: embedding, N blocks (mixer(s) + feed-forward, pre-norm residuals),
final norm, LM head. Parameter names follow Hugging Face Bamba; other families' checkpoint
names are mapped onto them by `families.weight_namer`.

A model is built for one TP rank and holds only that rank's shard; embedding, norms and
LM head are replicated. `forward` runs one packed step and returns logits.
"""
from __future__ import annotations

import torch
from torch import nn

from hyrax.actors.model import attention, gated_deltanet, mamba2
from hyrax.actors.model.attention import Attention
from hyrax.actors.model.batch import ForwardBatch
from hyrax.actors.model.config import ATTENTION_TYPES, MIXERS, ModelConfig
from hyrax.actors.model.gated_deltanet import GatedDeltaNet
from hyrax.actors.model.mamba2 import Mamba2Mixer
from hyrax.actors.model.mlp import GatedMLP, ReluSqMLP
from hyrax.actors.model.moe import MoE
from hyrax.actors.model.norm import AllReduce, RMSNorm, identity_allreduce
from hyrax.actors.model.rope import Rope
from hyrax.actors.model.sharding import TP
from hyrax.actors.model.state import ComponentSpec, component_by_name, derive_components

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


def resolve_dtype(name: str, device: torch.device | str, capability=None) -> torch.dtype:
    """The model dtype a `--dtype` name means on `device`. `auto`: float32 on the CPU; on a
    GPU bfloat16 where it computes bf16 natively (compute capability 8.0 and up), else
    float16 - the dtypes the FlashAttention backend runs (a float32 default never picks it).
    `capability` (device -> (major, minor)) is injectable for tests."""
    if name != "auto":
        return DTYPES[name]
    device = torch.device(device)
    if device.type != "cuda":
        return torch.float32
    if capability is None:
        from hyrax.actors.model.attn_backends import cuda_capability as capability
    return torch.bfloat16 if capability(device)[0] >= 8 else torch.float16


def _feed_forward(cfg: ModelConfig, kind: str, tp: TP, dtype: torch.dtype, allreduce: AllReduce) -> nn.Module:
    h, n = cfg.hidden_size, cfg.intermediate_size
    if kind == "gated":
        return GatedMLP(h, n, tp, dtype, allreduce, cfg.mlp_bias, cfg.mup.mlp_gate, cfg.mup.mlp_down)
    if kind == "relu2":
        return ReluSqMLP(h, n, tp, dtype, allreduce, cfg.mlp_bias)
    granite = cfg.model_type == "granitemoehybrid"
    return MoE(cfg, tp, dtype, allreduce, stacked_experts=granite, fused_shared=granite)


class DecoderLayer(nn.Module):
    """x + r * mixer(norm(x)), then x + r * ffn(norm(x)) (r: residual_multiplier). A layer may
    lack either part (NemotronH layers hold one of them); a Falcon-H1 layer runs attention and
    Mamba2 side by side on the same normalised input and adds both, each mixer's input and
    output scaled by its µP multipliers (`cfg.mup.mixer_scales`)."""

    def __init__(self, cfg: ModelConfig, tp: TP, layer_id: int, components: tuple[ComponentSpec, ...],
                 dtype: torch.dtype, allreduce: AllReduce, device: torch.device | str, attn_backend: str):
        super().__init__()
        ltype = cfg.layer_types[layer_id]
        self.layer_type = ltype
        self.mixers = MIXERS[ltype]
        self.scales = {m: cfg.mup.mixer_scales(m) for m in self.mixers}  # mixer -> (in, out)
        self.residual_multiplier = cfg.residual_multiplier
        eps, off = cfg.rms_norm_eps, cfg.norm_offset

        def local_index(component: str) -> int:
            return component_by_name(components)[component].layers.index(layer_id)

        if self.mixers:
            self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, off)
        for mixer in self.mixers:
            if mixer == "mamba2":
                self.mamba = Mamba2Mixer(cfg, tp, local_index(mamba2.CONV), dtype, allreduce, device)
            elif mixer == "gated_deltanet":
                self.linear_attn = GatedDeltaNet(cfg, tp, local_index(gated_deltanet.CONV), dtype, allreduce)
            else:
                comp = attention.COMPONENT[mixer]
                window = cfg.sliding_window if mixer == "sliding_attention" else None
                self.self_attn = Attention(cfg, tp, layer_id, comp, local_index(comp), window, dtype, allreduce,
                                           device, attn_backend)
        self.ffn_kind = cfg.ffn_kinds[layer_id]
        if self.ffn_kind != "none":
            self.pre_ff_layernorm = RMSNorm(cfg.hidden_size, eps, dtype, off)
            self.feed_forward = _feed_forward(cfg, self.ffn_kind, tp, dtype, allreduce)

    def forward(self, x, batch, pools, rope, cos_sin, packed: bool = False):
        """x: (B, T, hidden), or with `packed` (1, N, hidden), the step's real tokens only, and
        cos_sin packed likewise (HybridModel.forward): then a mixer that runs on packed tokens
        gets them as they are, any other its (B, T) rows (a MixedBatch's: each part's) and
        gives its output back packed."""
        r = self.residual_multiplier
        if self.mixers:
            h = self.input_layernorm(x)
            out = None
            for mixer in self.mixers:
                s_in, s_out = self.scales[mixer]
                h_in = h * s_in if s_in != 1.0 else h
                if not packed:
                    y = self._mixer(mixer, h_in, batch, pools, rope, cos_sin)
                elif mixer in ATTENTION_TYPES:
                    y = self.self_attn(h_in, batch, pools, rope, cos_sin, packed=True)
                else:  # the C Mamba2 step takes packed tokens; otherwise, and other mixers, rows
                    y = self.mamba.packed(h_in, batch, pools) if mixer == "mamba2" else None
                    if y is None:
                        y = batch.by_rows(lambda rows, part: self._mixer(mixer, rows, part, pools, rope, None), h_in)
                if s_out != 1.0:
                    y = y * s_out
                out = y if out is None else out + y
            x = torch.add(x, out, alpha=r)  # x + r * out in one op (r is 1 for most families)
        if self.ffn_kind != "none":
            x = torch.add(x, self.feed_forward(self.pre_ff_layernorm(x)), alpha=r)
        return x

    def _mixer(self, mixer: str, h, batch, pools, rope, cos_sin):
        """One mixer on (B, T, hidden) rows."""
        if mixer == "mamba2":
            return self.mamba(h, batch, pools)
        if mixer == "gated_deltanet":
            return self.linear_attn(h, batch, pools)
        return self.self_attn(h, batch, pools, rope, cos_sin)


class _Backbone(nn.Module):
    def __init__(self, cfg, tp, components, dtype, allreduce, device, attn_backend, embed_dtype):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, dtype=embed_dtype)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, tp, i, components, dtype, allreduce, device, attn_backend) for i in range(cfg.num_layers)
        )
        self.final_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, cfg.norm_offset)


class HybridModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP = TP(), dtype: torch.dtype = torch.float32,
                 allreduce: AllReduce = identity_allreduce, device: torch.device | str = "cpu",
                 attn_backend: str = "auto"):
        """`device` is where the model will run (it is built on the current default device and
        moved by the caller); with `attn_backend` it picks each attention layer's kernel."""
        super().__init__()
        self.cfg, self.tp, self.dtype = cfg, tp, dtype
        self.components = derive_components(cfg, tp, dtype)
        # logits in float32 (float64 for float64 models), never rounded to bf16/fp16 before
        # sampling: the head's weight is kept in that dtype, and so is the embedding table
        # when the two are tied (vocab x hidden x 2 more bytes than a bf16 head)
        self.logits_dtype = torch.promote_types(dtype, torch.float32)
        embed_dtype = self.logits_dtype if cfg.tie_word_embeddings else dtype
        self.model = _Backbone(cfg, tp, self.components, dtype, allreduce, device, attn_backend, embed_dtype)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=self.logits_dtype)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rope = Rope(cfg.head_dim, cfg.rotary_dim, cfg.rope_theta, dtype, device)  # runs where the model runs
        self.rope_freqs = self.rope.freqs  # a submodule: its buffer moves with the weights
        self.requires_grad_(False)

    @property
    def attention_backends(self) -> list:
        return [layer.self_attn.backend for layer in self.model.layers if hasattr(layer, "self_attn")]

    @property
    def attention_backend_name(self) -> str | None:
        names = sorted({b.name for b in self.attention_backends})
        return ",".join(names) if names else None

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        """Full parameter name -> (dim, global indices) for sharded params; absent = replicated."""
        rules = {}
        for prefix, mod in self.named_modules():
            if hasattr(mod, "shard_rules") and mod is not self:
                for k, v in mod.shard_rules().items():
                    rules[f"{prefix}.{k}"] = v
        return rules

    def forward(self, batch: ForwardBatch, pools: dict[str, torch.Tensor], all_logits: bool = False) -> torch.Tensor:
        """Run one step. Returns logits (B, vocab) at each sequence's last token, or
        (B, T, vocab) at every position with `all_logits`. Logits are float32 (float64 for
        float64 models)."""
        # several padded slices, or decode rows with prompt slices (a MixedBatch): the layers run
        # on the real tokens only, (1, N, hidden), so the token-wise work (projections, MLPs,
        # norms) skips the padding and runs once per step; mixers that need rows get them
        # unpacked (DecoderLayer.forward)
        packed = not all_logits and batch.packs
        ids, positions = batch.packed_inputs() if packed else (batch.input_ids, batch.positions)
        x = self.model.embed_tokens(ids).to(self.dtype)
        if self.cfg.embedding_multiplier != 1.0:
            x = x * self.cfg.embedding_multiplier
        cos_sin = self.rope.cos_sin(positions) if self.cfg.has_attention and self.cfg.use_rope else None
        for layer in self.model.layers:
            x = layer(x, batch, pools, self.rope, cos_sin, packed)
        if packed:
            x = x[0, batch.starts + batch.q_lens - 1]
        elif not all_logits:
            last = (batch.q_lens - 1).clamp(min=0)
            x = x[torch.arange(x.shape[0], device=x.device), last]
        x = self.model.final_layernorm(x)
        logits = self.lm_head(x.to(self.logits_dtype))
        return logits * self.cfg.logits_multiplier if self.cfg.logits_multiplier != 1.0 else logits
