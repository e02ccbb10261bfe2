"""A NemotronH config's layer pattern (Mamba2 / attention / relu2-MLP / MoE layers) becomes
Hyrax's layer and feed-forward types and state components, in both spellings of the pattern.
(Logits and greedy tokens against transformers: test_models_checkpoints.py.)"""
from __future__ import annotations

import json

import pytest
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.state import derive_components

pytest.importorskip("transformers")
from test_models_checkpoints import nemotron_h  # noqa: E402

PATTERN = "M*-EM-*E"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("nemotron_h")
    nemotron_h().save_pretrained(path)
    return path, None


def test_pattern_becomes_layer_types_and_components(checkpoint):
    path, _ = checkpoint
    cfg = ModelConfig.from_dir(path)
    assert cfg.layer_types == ("mamba2", "full_attention", "ffn_only", "ffn_only",
                               "mamba2", "ffn_only", "full_attention", "ffn_only")
    assert cfg.ffn_types == ("none", "none", "relu2", "moe", "none", "relu2", "none", "moe")
    comps = {c.name: c.layers for c in derive_components(cfg)}
    assert comps == {"full_kv": (1, 6), "mamba_conv": (0, 4), "mamba_ssm": (0, 4)}


def test_legacy_hybrid_override_pattern_config_is_read(checkpoint):
    path, _ = checkpoint
    d = json.loads((path / "config.json").read_text())
    d.pop("layers_block_type")
    d["hybrid_override_pattern"] = PATTERN
    d["num_hidden_layers"] = len(PATTERN)
    assert ModelConfig.from_hf_dict(d) == ModelConfig.from_dir(path)


def test_attention_bias_flag_without_the_biases_names_the_flag(checkpoint, tmp_path):
    """transformers' NemotronH ignores `attention_bias` (its projections never have biases) while
    NVIDIA's own modeling code reads it: a checkpoint that sets the flag but holds no attention
    biases is refused with a message about the flag, not a bare missing-weights one."""
    import shutil

    from hyrax.actors.model.errors import HyraxInputError
    from hyrax.actors.model.loader import load_model

    path, _ = checkpoint
    copy = tmp_path / "flagged"
    shutil.copytree(path, copy)
    d = json.loads((copy / "config.json").read_text())
    d["attention_bias"] = True
    (copy / "config.json").write_text(json.dumps(d))
    with pytest.raises(HyraxInputError) as err:
        load_model(str(copy), row_plans=False)
    msg = str(err.value)
    assert "attention_bias: true" in msg and "set attention_bias to false" in msg and "\n" not in msg, msg
