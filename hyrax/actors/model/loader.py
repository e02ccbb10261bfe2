"""Checkpoint loading and saving (HF-format directories with `*.safetensors`).

A rank reads only its shard: for each parameter the model's shard rules give the global
indices along one dimension, and contiguous runs of them are read with positional reads
straight into the parameter (safetensors_io.py), so a rank's memory holds its shard and not
the checkpoint. Replicated parameters (embeddings, norms, LM head, routers) are read whole.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from hyrax.actors.model.captured_decode import capture_decode
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.families import weight_namer
from hyrax.actors.model.gemm_rows import plan_rows
from hyrax.actors.model.ssd_readout import plan_readouts
from hyrax.actors.model.hybrid import HybridModel
from hyrax.actors.model.no_init import weights_left_uninitialised
from hyrax.actors.model.norm import AllReduce, identity_allreduce
from hyrax.actors.model.safetensors_io import SafetensorsFile
from hyrax.actors.model.sharding import TP, check_tp


def _fill(h: SafetensorsFile, name: str, rule, target: torch.Tensor) -> None:
    """Copy a checkpoint tensor (or this rank's slice of it, `rule` = (dim, indices)) into
    `target`: read in place when dtype and device allow, else through one slice-sized buffer."""
    dim, idx = rule if rule is not None else (None, None)
    if h.dtype(name) == target.dtype and target.device.type == "cpu" and target.is_contiguous():
        h.read_into(name, target.data, dim, idx)
    else:
        target.copy_(h.read(name, dim, idx).to(target.dtype))


def load_model(path: str | Path, tp: TP = TP(), dtype: torch.dtype = torch.float32,
               allreduce: AllReduce = identity_allreduce, device: str | torch.device = "cpu",
               attn_backend: str = "auto", captured_decode: str = "off", row_plans: bool = True) -> HybridModel:
    """The model in `path` for TP rank `tp`, on `device`; `captured_decode` (CAPTURE_MODES):
    how its decode-only steps run (captured_decode.py; "off": eager like every other step).
    `row_plans`: a CPU model's linear layers run products of few rows by their measured row
    plans (gemm_rows.py), its SSD decode readouts in their measured form (ssd_readout.py); off,
    every product is plain - a pure function of its inputs on any
    process, which deterministic mode asks for (plans are measured per process)."""
    p = Path(path)
    cfg = ModelConfig.from_dir(p)
    check_tp(cfg, tp.size)
    files = weight_files(p)
    name_of = weight_namer(cfg)
    if cfg.tie_word_embeddings and _stores_lm_head(files, name_of):
        # as transformers does: a head the checkpoint stores is used, tied config or not
        cfg = dataclasses.replace(cfg, tie_word_embeddings=False)
    with weights_left_uninitialised():  # every weight is read from the checkpoint below
        model = HybridModel(cfg, tp, dtype, allreduce, device, attn_backend)
    with torch.device("meta"), weights_left_uninitialised():  # the unsharded shapes, to check against
        full_shapes = {k: tuple(v.shape) for k, v in HybridModel(cfg, TP(), dtype, attn_backend="sdpa").named_parameters()}
    rules = model.shard_rules()
    params = dict(model.named_parameters(remove_duplicate=False))
    loaded: dict[str, str] = {}  # parameter -> the file it came from
    for f in files:
        with SafetensorsFile(f) as h:
            for ckpt_name in h.keys():
                name = name_of(ckpt_name)
                if name is None:
                    continue  # rotary caches, multi-token-prediction heads: not the served model
                if name not in params and name in full_shapes:
                    continue  # a row-parallel bias: rank 0 adds it
                if name not in params:
                    raise HyraxInputError(f"checkpoint weight {ckpt_name!r} has no place in the model the config "
                                          f"describes (model_type {cfg.model_type!r})")
                if name in loaded:
                    raise HyraxInputError(f"checkpoint weight {ckpt_name!r} is in both {loaded[name]} and {f.name}")
                saved = h.shape(ckpt_name)
                if saved != full_shapes[name]:
                    raise HyraxInputError(
                        f"weight {name}: checkpoint shape {saved} does not fit the config (expected {full_shapes[name]})"
                    )
                rule, target = rules.get(name), params[name]
                local = list(saved)
                if rule is not None:
                    local[rule[0]] = len(rule[1])
                if tuple(local) != tuple(target.shape):
                    raise HyraxInputError(
                        f"weight {name}: checkpoint shape {tuple(local)} does not fit the config "
                        f"(expected {tuple(target.shape)} on TP rank {tp.rank}/{tp.size})"
                    )
                with torch.no_grad():
                    _fill(h, ckpt_name, rule, target)
                loaded[name] = f.name
    missing = set(params) - loaded.keys()
    if cfg.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise HyraxInputError(_missing_message(cfg, sorted(missing)))
    model = model.to(device)
    if row_plans and torch.device(device).type == "cpu":  # products of few rows run the BLAS's fastest way
        plan_rows(model)
        plan_readouts(model)  # and the SSD decode readout the form this CPU runs faster
    capture_decode(model, captured_decode, device)
    return model


_BIAS_FLAGS = {  # config flag -> the parameter names (their last two parts) it adds
    "attention_bias": ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias"),
    "mlp_bias": ("gate_proj.bias", "up_proj.bias", "down_proj.bias"),
}


def _missing_message(cfg: ModelConfig, missing: list[str]) -> str:
    """What to say of weights the model has and the checkpoint lacks. When every one of them
    is a bias that a config flag asked for, name the flag: some families' configs set a bias
    flag that transformers ignores (NemotronH's `attention_bias`) for a checkpoint without
    those biases."""
    for flag, tails in _BIAS_FLAGS.items():
        if getattr(cfg, flag, False) and all(name.endswith(tails) for name in missing):
            return (f"config.json sets {flag}: true but the checkpoint has none of those biases "
                    f"({len(missing)} missing, e.g. {missing[0]}); if the model was trained without them, "
                    f"set {flag} to false")
    return f"checkpoint lacks {len(missing)} weights, e.g. {missing[0]}"


def weight_files(p: Path) -> list[Path]:
    """The weight files transformers reads in `p`: model.safetensors, else those that
    model.safetensors.index.json maps weights to; without either, every *.safetensors."""
    single, index = p / "model.safetensors", p / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError):
            raise HyraxInputError(f"{index} is not a safetensors index (no weight_map of names to files)") from None
        absent = [n for n in names if not (p / n).is_file()]
        if absent:
            raise HyraxInputError(f"{index} maps weights to {absent[0]!r}, which {str(p)!r} lacks")
        return [p / n for n in names]
    files = sorted(p.glob("*.safetensors"))
    if not files:
        raise HyraxInputError(f"{str(p)!r} has no *.safetensors weight files")
    return files


def _stores_lm_head(files: list[Path], name_of) -> bool:
    for f in files:
        with SafetensorsFile(f) as h:
            if any(name_of(n) == "lm_head.weight" for n in h.keys()):
                return True
    return False


def save_model(model: HybridModel, path: str | Path) -> None:
    """Save an unsharded model as an HF-format directory (config.json + model.safetensors)."""
    if model.tp.size != 1:
        raise ValueError("save_model needs an unsharded (tp_size == 1) model")
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    (p / "config.json").write_text(json.dumps(model.cfg.to_hf_dict(), indent=2))
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    if model.cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(p / "model.safetensors"))
