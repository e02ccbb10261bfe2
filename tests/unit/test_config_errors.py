"""Bad checkpoints and configs fail with a clear one-line HyraxInputError; configs round-trip."""
from __future__ import annotations

import json

import pytest
import torch

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.hybrid import HybridModel
from hyrax.actors.model.loader import load_model, save_model
from tiny_models import LAYOUTS, tiny_config


def raises_input_error(fn, *fragments: str) -> str:
    """Call fn, expect HyraxInputError whose one-line message names every fragment."""
    with pytest.raises(HyraxInputError) as info:
        fn()
    msg = str(info.value)
    assert "\n" not in msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"
    return msg


def hf_dict(**changes) -> dict:
    d = tiny_config("full_swa_mamba").to_hf_dict()
    d.update(changes)
    return d


def test_directory_without_config_json_is_rejected(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    raises_input_error(lambda: ModelConfig.from_dir(tmp_path), "config.json")
    raises_input_error(lambda: load_model(tmp_path), "config.json")


def test_missing_path_is_rejected(tmp_path):
    raises_input_error(lambda: load_model(tmp_path / "nope"), "not a directory")


def test_invalid_json_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text('{"vocab_size": 64,')
    raises_input_error(lambda: ModelConfig.from_dir(tmp_path), "config.json", "not valid JSON")


def test_json_that_is_not_an_object_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text("[1, 2]")
    raises_input_error(lambda: ModelConfig.from_dir(tmp_path), "config.json")


def test_unknown_layer_type_is_rejected_by_name():
    types = ["full_attention", "banana_attention", "mamba2", "mamba2"]
    raises_input_error(lambda: ModelConfig.from_hf_dict(hf_dict(layer_types=types)), "layer 1", "banana_attention")


def test_sliding_attention_without_window_is_rejected():
    raises_input_error(lambda: ModelConfig.from_hf_dict(hf_dict(sliding_window=None)), "sliding_window")
    raises_input_error(lambda: tiny_config("swa", sliding_window=None), "sliding_window")


def test_missing_required_key_is_named():
    d = hf_dict()
    del d["hidden_size"]
    raises_input_error(lambda: ModelConfig.from_hf_dict(d), "hidden_size")


def test_layer_count_disagreeing_with_num_hidden_layers_is_rejected():
    raises_input_error(lambda: ModelConfig.from_hf_dict(hf_dict(num_hidden_layers=3)), "num_hidden_layers=3")


def test_directory_without_weights_is_rejected(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(hf_dict()))
    raises_input_error(lambda: load_model(tmp_path), "safetensors")


@pytest.mark.parametrize("size", [
    128,
    32,
], ids=["config_larger", "config_smaller"])
def test_weights_that_do_not_fit_the_config_are_rejected(tmp_path, size):
    save_model(HybridModel(tiny_config("full")), tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["intermediate_size"] = size  # the checkpoint was saved with 64
    (tmp_path / "config.json").write_text(json.dumps(d))
    raises_input_error(lambda: load_model(tmp_path), "feed_forward", "does not fit the config")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_config_round_trips_through_hf_dict_and_json(tmp_path, layout):
    cfg = tiny_config(layout, eos_token_id=(2, 7), bos_token_id=1, tie_word_embeddings=True,
                      time_step_limit=(0.001, float("inf")))
    assert ModelConfig.from_hf_dict(cfg.to_hf_dict()) == cfg
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert ModelConfig.from_dir(tmp_path) == cfg


def test_saved_model_reloads_with_identical_weights(tmp_path):
    model = HybridModel(tiny_config("full_swa_mamba"), dtype=torch.float64)
    for p in model.parameters():
        p.normal_()
    save_model(model, tmp_path)
    again = load_model(tmp_path, dtype=torch.float64)
    assert again.cfg == model.cfg
    for (name, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), name
