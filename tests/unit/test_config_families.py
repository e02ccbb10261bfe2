"""config.json handling for the Hugging Face families: every key is used or on the documented
inert list; anything else — an unknown key, an unsupported activation, RoPE scaling type or
quantization, an unknown model_type or layer symbol — is a one-line HyraxInputError naming it."""
from __future__ import annotations

import json

import pytest

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.families import INERT_KEYS
from test_config_errors import raises_input_error

transformers = pytest.importorskip("transformers")


def hf_config_dict(tmp_path, name: str) -> dict:
    cfg = {
        "nemotron_h": lambda: transformers.NemotronHConfig(
            hybrid_override_pattern="M*-E", hidden_size=64, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
            ssm_state_size=16, num_attention_heads=4, num_key_value_heads=2, head_dim=16),
        "granitemoehybrid": lambda: transformers.GraniteMoeHybridConfig(
            hidden_size=64, num_hidden_layers=2, layer_types=["mamba", "attention"], mamba_n_heads=8, mamba_d_head=16,
            num_local_experts=4, position_embedding_type="rope"),
        "bamba": lambda: transformers.BambaConfig(
            hidden_size=64, num_hidden_layers=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=16),
        "falcon_h1": lambda: transformers.FalconH1Config(
            hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, mamba_d_ssm=128,
            mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, key_multiplier=0.5),
    }[name]()
    cfg.save_pretrained(tmp_path)
    return json.loads((tmp_path / "config.json").read_text())


FAMILIES = ["nemotron_h", "granitemoehybrid", "bamba", "falcon_h1"]


@pytest.mark.parametrize("family", FAMILIES)
def test_config_written_by_transformers_is_accepted(tmp_path, family):
    cfg = ModelConfig.from_hf_dict(hf_config_dict(tmp_path, family))
    assert cfg.model_type == family


@pytest.mark.parametrize("family", FAMILIES)
def test_the_time_step_init_range_written_by_older_transformers_is_accepted(tmp_path, family):
    """transformers releases up to 5.7 write `time_step_min` (with `time_step_max` and
    `time_step_floor`) into Bamba, GraniteMoeHybrid and FalconH1 configs: the range dt_bias was
    initialised from, read by no forward; checkpoints saved then carry it. NemotronH too clamps
    dt to `time_step_limit`, not at `time_step_min` (test_family_config_variants.py)."""
    d = hf_config_dict(tmp_path, family)
    plain = ModelConfig.from_hf_dict({k: v for k, v in d.items() if k != "time_step_min"})
    d.update(time_step_min=0.002, time_step_max=0.2, time_step_floor=0.0002)
    assert ModelConfig.from_hf_dict(d) == plain


@pytest.mark.parametrize("family", FAMILIES)
def test_unknown_key_is_refused_by_name(tmp_path, family):
    d = hf_config_dict(tmp_path, family)
    d["attention_logit_softcapping"] = 30.0
    raises_input_error(lambda: ModelConfig.from_hf_dict(d), "'attention_logit_softcapping'", family)


@pytest.mark.parametrize("family,key,value", [
    ("granitemoehybrid", "hidden_act", "gelu"),
    ("nemotron_h", "mlp_hidden_act", "silu"),
    ("nemotron_h", "mamba_hidden_act", "gelu"),
    ("granitemoehybrid", "position_embedding_type", "alibi"),
    ("nemotron_h", "residual_in_fp32", True),
    ("nemotron_h", "num_nextn_predict_layers", 1),
    ("falcon_h1", "hidden_act", "gelu"),
    ("falcon_h1", "mamba_use_mlp", False),
])
def test_unsupported_value_is_refused_by_key(tmp_path, family, key, value):
    d = hf_config_dict(tmp_path, family)
    d[key] = value
    raises_input_error(lambda: ModelConfig.from_hf_dict(d), repr(key), repr(value))


@pytest.mark.parametrize("rope", [{"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4},
                                  {"rope_type": "default", "rope_theta": 1e4, "mrope_section": [1, 2]}])
def test_rope_scaling_is_refused(tmp_path, rope):
    d = hf_config_dict(tmp_path, "granitemoehybrid")
    d["rope_parameters"] = rope
    raises_input_error(lambda: ModelConfig.from_hf_dict(d), "rope")


def test_quantized_checkpoint_is_refused(tmp_path):
    d = hf_config_dict(tmp_path, "bamba")
    d["quantization_config"] = {"quant_method": "fp8"}
    raises_input_error(lambda: ModelConfig.from_hf_dict(d), "quantization_config")


def test_unknown_model_type_is_refused_by_name(tmp_path):
    d = hf_config_dict(tmp_path, "bamba")
    d["model_type"] = "jamba"
    raises_input_error(lambda: ModelConfig.from_hf_dict(d), "'jamba'", "nemotron_h")


def test_unknown_nemotron_layer_symbol_is_refused(tmp_path):
    d = hf_config_dict(tmp_path, "nemotron_h")
    del d["layers_block_type"]
    d["hybrid_override_pattern"] = "M*X"
    raises_input_error(lambda: ModelConfig.from_hf_dict(d), "'X'")


def test_inert_keys_are_training_or_bookkeeping_only():
    # mutation guard: a key that changes the computation must never be declared inert
    for key in ("hidden_act", "rope_parameters", "residual_multiplier", "time_step_limit", "sliding_window",
                "key_multiplier", "ssm_multipliers", "mlp_multipliers", "projectors_bias", "mamba_rms_norm"):
        assert key not in INERT_KEYS
