"""Config values away from the defaults the family tests use, each in a tiny random checkpoint
that transformers writes: the checkpoint either loads and computes transformers' logits
(prefill, chunked prefill, decode steps; TP 2 where the value touches sharded weights) or is
refused with a one-line error naming the key. Never loaded with other math."""
from __future__ import annotations

import json

import pytest
import torch

import hf_families as hff
from test_config_errors import raises_input_error

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=hff.VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
              intermediate_size=96, initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=0)
MAMBA = dict(mamba_n_heads=8, mamba_d_head=16, mamba_n_groups=2, mamba_d_state=16, mamba_d_conv=4,
             mamba_chunk_size=8)
CHUNKS = ([21], [8, 5, 8], [16, 1, 1, 1, 1, 1])


def nemotron_h(**overrides):
    return transformers.NemotronHForCausalLM(transformers.NemotronHConfig(**{
        **COMMON, "hybrid_override_pattern": "M*-EM-*E", "head_dim": 16, "mamba_num_heads": 8,
        "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16, "conv_kernel": 4, "chunk_size": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1, **overrides}))


def bamba(**overrides):
    return transformers.BambaForCausalLM(transformers.BambaConfig(**{
        **COMMON, **MAMBA, "num_hidden_layers": 3, "attn_layer_indices": [1], **overrides}))


def granite(**overrides):
    return transformers.GraniteMoeHybridForCausalLM(transformers.GraniteMoeHybridConfig(**{
        **COMMON, **MAMBA, "num_hidden_layers": 2, "layer_types": ["mamba", "attention"],
        "shared_intermediate_size": 48, "num_local_experts": 4, "num_experts_per_tok": 2,
        "position_embedding_type": "rope", **overrides}))


def falcon_h1(**overrides):
    return transformers.FalconH1ForCausalLM(transformers.FalconH1Config(**{
        **COMMON, "num_hidden_layers": 2, "mamba_d_ssm": 96, "mamba_n_heads": 6, "mamba_d_head": 16,
        "mamba_n_groups": 2, "mamba_d_state": 16, "mamba_d_conv": 4, "mamba_chunk_size": 8, **overrides}))


def qwen3_next(**overrides):
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{
        **COMMON, "num_hidden_layers": 2, "head_dim": 16, "layer_types": ["linear_attention", "full_attention"],
        "linear_num_value_heads": 4, "linear_num_key_heads": 2, "linear_key_head_dim": 16,
        "linear_value_head_dim": 16, **overrides}))


def save(hf, path, seed: int = 3):
    """Randomise (recurrent parameters, norms, and every bias, so that a dropped bias shows) and save."""
    torch.manual_seed(0)
    hf = hff.randomize_hf_(hf.eval())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    hf.save_pretrained(path)
    return hf


def assert_matches_transformers(path, hf, tp2: bool = False):
    ids = hff.prompts((21,))[0]
    for chunks in CHUNKS:
        assert hff.teacher_forced_max_diff(path, hf, ids, chunks) < 1e-4, chunks
    if tp2:
        ref = hff.hf_logits(hf, ids)
        for logits in hff.rank_logits(path, 2, ids, [8, 13]):
            torch.testing.assert_close(logits, ref, atol=1e-4, rtol=0)


def test_nemotron_h_clamps_dt_at_time_step_limit(tmp_path):
    """transformers' NemotronH clamps dt to `time_step_limit` (as the Mamba2 kernels it was
    trained with do), not from below at `time_step_min`, an initialisation bound."""
    hf = save(nemotron_h(time_step_limit=[0.05, 0.5]), tmp_path)
    assert_matches_transformers(tmp_path, hf)


def test_nemotron_h_time_step_min_does_not_clamp_dt(tmp_path):
    hf = save(nemotron_h(time_step_min=0.3), tmp_path)
    assert_matches_transformers(tmp_path, hf)


@pytest.mark.parametrize("build", [granite, falcon_h1], ids=["granitemoehybrid", "falcon_h1"])
@pytest.mark.parametrize("where", ["rope_parameters", "top_level"])
def test_partial_rotary_factor_is_refused_where_transformers_rotates_the_whole_head(tmp_path, build, where):
    """transformers' Granite and Falcon-H1 rotate every channel of a head whatever
    `partial_rotary_factor` says (older releases failed on it); Hyrax rotated only that part."""
    save(build(), tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    if where == "top_level":
        d["partial_rotary_factor"] = 0.5
    else:
        d["rope_parameters"] = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 0.5}
    p.write_text(json.dumps(d))
    raises_input_error(lambda: hff.load_model(tmp_path), "'partial_rotary_factor'")


@pytest.mark.parametrize("build", [granite, falcon_h1], ids=["granitemoehybrid", "falcon_h1"])
def test_whole_head_rope_with_its_own_theta_matches_transformers(tmp_path, build):
    rope = {"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 1.0}
    hf = save(build(rope_parameters=rope), tmp_path)
    assert_matches_transformers(tmp_path, hf)


def test_nemotron_h_never_ties_its_lm_head_to_the_embeddings(tmp_path):
    """transformers' NemotronH keeps its own LM head even with `tie_word_embeddings: true`."""
    hf = save(nemotron_h(tie_word_embeddings=True), tmp_path)
    assert not torch.equal(hf.lm_head.weight, hf.model.embeddings.weight)
    assert_matches_transformers(tmp_path, hf)


def test_a_tied_config_whose_checkpoint_carries_its_own_lm_head_uses_that_head(tmp_path):
    """transformers does not tie an LM head that the checkpoint stores with other values than
    the embeddings (it warns); such a checkpoint computes with the stored head."""
    from safetensors.torch import load_file, save_file

    save(bamba(tie_word_embeddings=True), tmp_path)
    f = tmp_path / "model.safetensors"
    weights = load_file(f)
    weights["lm_head.weight"] = torch.randn(weights["model.embed_tokens.weight"].shape)
    save_file(weights, f, metadata={"format": "pt"})
    hf = transformers.BambaForCausalLM.from_pretrained(tmp_path).eval()
    assert torch.equal(hf.lm_head.weight, weights["lm_head.weight"])
    assert_matches_transformers(tmp_path, hf)


def test_bamba_head_dim_apart_from_hidden_over_heads_matches_transformers(tmp_path):
    """BambaConfig has no head_dim argument, but transformers' Bamba attention and RoPE read a
    `head_dim` the config carries (here 32, against hidden_size / heads = 16)."""
    hf = save(bamba(head_dim=32), tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["head_dim"] == 32
    assert_matches_transformers(tmp_path, hf, tp2=True)


def test_nemotron_h_mlp_bias_reaches_the_shared_expert(tmp_path):
    """NemotronH's `mlp_bias` puts biases on its relu² MLPs and on the MoE's shared expert
    (the routed experts have none)."""
    hf = save(nemotron_h(mlp_bias=True), tmp_path)
    assert hf.model.layers[3].mixer.shared_experts.down_proj.bias is not None
    assert_matches_transformers(tmp_path, hf, tp2=True)


def test_dense_qwen3_next_without_experts_loads_its_unused_moe_keys(tmp_path):
    """num_experts 0: every layer is a dense SwiGLU MLP; Qwen3NextConfig still writes its MoE
    keys (moe_intermediate_size, ...), which then change nothing."""
    hf = save(qwen3_next(num_experts=0), tmp_path)
    assert "moe_intermediate_size" in json.loads((tmp_path / "config.json").read_text())
    assert_matches_transformers(tmp_path, hf)


def test_bamba_top_level_partial_rotary_factor_other_than_half_is_refused(tmp_path):
    """transformers' Bamba rotates half of each head unless `rope_parameters` says otherwise: a
    top-level `partial_rotary_factor` is overridden with 0.5 (older releases hard-coded 0.5
    everywhere). Hyrax honoured the top-level value, 0.6 away from transformers' logits."""
    save(bamba(), tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    d["rope_parameters"].pop("partial_rotary_factor")
    d["partial_rotary_factor"] = 1.0
    p.write_text(json.dumps(d))
    raises_input_error(lambda: hff.load_model(tmp_path), "'partial_rotary_factor'")
    d["partial_rotary_factor"] = 0.5  # what transformers uses: accepted
    p.write_text(json.dumps(d))
    assert hff.load_model(tmp_path).cfg.rotary_dim == 8


def test_bamba_partial_rotary_factor_in_rope_parameters_matches_transformers(tmp_path):
    hf = save(bamba(rope_parameters={"rope_type": "default", "rope_theta": 100.0, "partial_rotary_factor": 1.0}),
              tmp_path)
    assert_matches_transformers(tmp_path, hf)


def test_bamba_layer_types_are_refused_by_name(tmp_path):
    """A Bamba's layers come from `attn_layer_indices` alone (transformers cannot even load a
    BambaConfig carrying `layer_types`); Hyrax took `layer_types` from its own dialect, sliding
    windows included, and computed what no Bamba does."""
    save(bamba(), tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    del d["attn_layer_indices"]
    d.update(layer_types=["mamba", "sliding_attention", "mamba"], sliding_window=4)
    p.write_text(json.dumps(d))
    raises_input_error(lambda: hff.load_model(tmp_path), "'layer_types'", "bamba")


@pytest.mark.parametrize("layer_type", ["sliding_attention", "gated_deltanet"])
def test_granite_layer_type_of_another_family_is_refused_by_name(tmp_path, layer_type):
    """Granite layers are Mamba2 or full attention (transformers builds attention for any other
    name); Hyrax passed other names through as its own layer types, e.g. sliding-window."""
    save(granite(), tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    d.update(layer_types=["mamba", layer_type], sliding_window=4)
    p.write_text(json.dumps(d))
    raises_input_error(lambda: hff.load_model(tmp_path), repr(layer_type))


@pytest.mark.parametrize("change", [dict(embedding_multiplier=2.0), dict(qk_norm=True), dict(mamba_norm="gate_only"),
                                    dict(ffn_types=("relu2",) * 4)], ids=lambda c: next(iter(c)))
def test_saving_a_model_hyrax_dialect_cannot_describe_is_refused(tmp_path, change):
    """save_model writes Hyrax's own config dialect; a model with anything that dialect has no
    key for (another family's multipliers, norms, feed-forward kinds) was written without it
    and reloaded computing something else."""
    from dataclasses import replace

    from hyrax.actors.model.hybrid import HybridModel
    from hyrax.actors.model.loader import save_model
    from tiny_models import tiny_config

    model = HybridModel(replace(tiny_config("full_swa_mamba"), **change))
    with pytest.raises(ValueError, match=next(iter(change))):
        save_model(model, tmp_path)


def test_a_stale_weight_file_beside_model_safetensors_is_not_read(tmp_path):
    """transformers reads model.safetensors (else the files its index names), nothing else in
    the directory; Hyrax read every *.safetensors, so a stale file's weights replaced the
    checkpoint's."""
    from safetensors.torch import save_file

    hf = save(bamba(), tmp_path)
    save_file({"model.embed_tokens.weight": torch.randn(hff.VOCAB, 64)}, tmp_path / "stale.safetensors")
    reread = transformers.BambaForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reread.model.embed_tokens.weight, hf.model.embed_tokens.weight)
    assert_matches_transformers(tmp_path, hf)


def test_a_weight_in_two_files_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    save(bamba(), tmp_path)
    weights = load_file(tmp_path / "model.safetensors")
    (tmp_path / "model.safetensors").unlink()
    save_file(weights, tmp_path / "a.safetensors")
    save_file({"model.embed_tokens.weight": torch.randn(hff.VOCAB, 64)}, tmp_path / "b.safetensors")
    raises_input_error(lambda: hff.load_model(tmp_path), "'model.embed_tokens.weight'", "a.safetensors",
                       "b.safetensors")


@pytest.mark.parametrize("build,absent", [
    (lambda: qwen3_next(num_experts=12, moe_intermediate_size=8, shared_expert_intermediate_size=16),
     ["num_experts_per_tok", "norm_topk_prob"]),
    (granite, ["num_experts_per_tok"]),
], ids=["qwen3_next", "granitemoehybrid"])
def test_routing_keys_left_out_of_config_json_take_transformers_defaults(tmp_path, build, absent):
    """A config.json may leave out keys whose value is the config class's default; transformers
    then routes to its default top-k (Qwen3-Next 10, Granite 2) and renormalises Qwen3-Next's
    weights, where Hyrax routed to 1 expert without renormalising, with the same weights."""
    hf = save(build(), tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    for key in absent:
        del d[key]
    p.write_text(json.dumps(d))
    reread = type(hf).from_pretrained(tmp_path).eval()
    assert reread.config.num_experts_per_tok == hf.config.num_experts_per_tok > 1
    assert_matches_transformers(tmp_path, reread)


def test_qwen3_next_layers_from_full_attention_interval(tmp_path):
    """Qwen3-Next configs may give `full_attention_interval` instead of `layer_types` (every
    interval-th layer full attention, the others Gated DeltaNet), as transformers reads them."""
    save(qwen3_next(num_hidden_layers=4, layer_types=None, full_attention_interval=2, mlp_only_layers=[0, 1, 2, 3]),
         tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    del d["layer_types"]
    d["full_attention_interval"] = 2
    p.write_text(json.dumps(d))
    reread = transformers.Qwen3NextForCausalLM.from_pretrained(tmp_path).eval()
    assert reread.config.layer_types == ["linear_attention", "full_attention"] * 2
    assert_matches_transformers(tmp_path, reread)


def test_granite_normalization_function_rmsnorm_loads_and_another_is_refused(tmp_path):
    """Granite configs written by IBM's training code carry `normalization_function`; transformers
    ignores it and always computes RMSNorm, so only "rmsnorm" can load."""
    hf = save(granite(), tmp_path)
    p = tmp_path / "config.json"
    d = json.loads(p.read_text())
    p.write_text(json.dumps({**d, "normalization_function": "rmsnorm"}))
    assert_matches_transformers(tmp_path, hf)
    p.write_text(json.dumps({**d, "normalization_function": "layernorm"}))
    raises_input_error(lambda: hff.load_model(tmp_path), "'normalization_function'", "'layernorm'")
