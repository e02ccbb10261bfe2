"""Every supported Hugging Face hybrid family, from a tiny random checkpoint that
transformers writes (float32), computes what transformers computes: teacher-forced logits
within 1e-4 (one prefill, and chunked), the same logits on every TP rank, and greedy tokens
equal to `generate` for prompts shorter and longer than a prefill chunk, at TP 1 and 2, and
at TP 2 under forced retraction every 3 steps in every backup mode."""
from __future__ import annotations

import pytest
import torch

import hf_families as hff

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=hff.VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
             mamba_chunk_size=8)


def nemotron_h():
    return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(
        **COMMON, hybrid_override_pattern="M*-EM-*E", head_dim=16,
        mamba_num_heads=8, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=8,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        moe_shared_expert_intermediate_size=48, n_group=2, topk_group=1, routed_scaling_factor=1.5,
    ))


def granite_rope_moe():
    """Granite 4.0-H: Mamba2 + RoPE attention, 4 experts + a shared MLP, every multiplier set."""
    return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
        **COMMON, **MAMBA, num_hidden_layers=4, layer_types=["mamba", "attention", "mamba", "attention"],
        shared_intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, position_embedding_type="rope",
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.5,
    ))


def granite_nope_dense():
    """Granite 4.0-H micro style: no routed experts (shared MLP only), attention without positions."""
    return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(
        **COMMON, **MAMBA, num_hidden_layers=3, layer_types=["mamba", "attention", "mamba"],
        shared_intermediate_size=48, num_local_experts=0, attention_multiplier=0.3, embedding_multiplier=3.0,
    ))


def qwen3_next():
    """Gated DeltaNet + gated attention (partial RoPE, q/k norm), MoE with a gated shared expert;
    layer 1 dense (mlp_only_layers). Grouped value heads: 4 value heads over 2 key heads."""
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(
        **COMMON, num_hidden_layers=4, head_dim=16, layer_types=["linear_attention", "linear_attention",
                                                                  "full_attention", "linear_attention"],
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4, num_experts_per_tok=2,
        norm_topk_prob=True, mlp_only_layers=[1], linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=16,
    ))


FALCON = dict(num_hidden_layers=3, mamba_d_ssm=96, mamba_n_heads=6, mamba_d_head=16, mamba_n_groups=2,
              mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=8)
FALCON_MUP = dict(embedding_multiplier=1.7, lm_head_multiplier=0.6, attention_in_multiplier=0.8,
                  attention_out_multiplier=1.3, key_multiplier=0.7, ssm_in_multiplier=1.4, ssm_out_multiplier=0.9,
                  ssm_multipliers=[0.5, 1.5, 0.8, 1.2, 0.6], mlp_multipliers=[1.3, 0.7])


def falcon_h1(**overrides):
    """Falcon-H1: attention ∥ Mamba2 in every layer, every µP multiplier set, a Mamba width
    (mamba_d_ssm = 96) unlike mamba_expand * hidden_size, the norm before the gate, biases on
    attention and the Mamba out_proj (projectors_bias) but not its in_proj, randomised."""
    cfg = {**COMMON, **FALCON, **FALCON_MUP, "mamba_rms_norm": True, "mamba_norm_before_gate": True,
           "attention_bias": True, "projectors_bias": True, "mamba_proj_bias": False, **overrides}
    hf = transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**cfg))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return hf


FAMILIES = {"nemotron_h": nemotron_h, "granite_rope_moe": granite_rope_moe, "granite_nope_dense": granite_nope_dense,
            "qwen3_next": qwen3_next, "falcon_h1": falcon_h1}


@pytest.fixture(scope="module", params=list(FAMILIES))
def checkpoint(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = hff.randomize_hf_(FAMILIES[request.param]().eval())
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    ps = hff.prompts()
    return path, hf, ps, [hff.hf_generate(hf, p) for p in ps]


@pytest.mark.parametrize("chunks", [[21], [8, 5, 8], [16, 1, 1, 1, 1, 1]], ids=["one_chunk", "chunked", "decode_steps"])
def test_teacher_forced_logits_match_transformers(checkpoint, chunks):
    path, hf, _, _ = checkpoint
    ids = hff.prompts((21,))[0]
    assert hff.teacher_forced_max_diff(path, hf, ids, chunks) < 1e-4


def test_tp2_ranks_compute_the_transformers_logits(checkpoint):
    path, hf, _, _ = checkpoint
    ids = hff.prompts((13,))[0]
    ref = hff.hf_logits(hf, ids)
    for logits in hff.rank_logits(path, 2, ids, [8, 5]):
        torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("tp_size", [1, 2])
def test_greedy_tokens_equal_transformers_generate(checkpoint, tp_size):
    path, _, ps, ref = checkpoint
    assert hff.engine_greedy(hff.make_engine(path, tp_size), ps) == ref


@pytest.mark.parametrize("mode", hff.MODES)
def test_forced_retraction_every_3_steps_keeps_transformers_tokens(checkpoint, mode):
    path, _, ps, ref = checkpoint
    e = hff.make_engine(path, 2, forced_retraction_interval=3, retraction_backup=mode)
    assert hff.engine_greedy(e, ps) == ref
    s = e.stats.summary()
    assert s["retractions"] >= 3 and s["checksum_failures"] == 0 and s["restore_fallbacks"] == 0, s
    if mode != "recompute":  # every declared component (gdn_* included) went out and came back
        assert set(s["bytes_backed_up"]) == {c.name for c in e.components}, s
        assert s["bytes_restored"] == s["bytes_backed_up"], s


def test_float16_model_tracks_the_float32_logits(checkpoint):
    path, hf, _, _ = checkpoint
    ids = hff.prompts((13,))[0]
    half = hff.run_in_chunks(hff.load_model(path, dtype=torch.float16), ids, [8, 5])
    ref = hff.hf_logits(hf, ids)
    assert half.dtype == torch.float32 and torch.isfinite(half).all()
    assert (half - ref).abs().max() < 0.05
