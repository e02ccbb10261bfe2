"""The shipped demo checkpoint: a small full + sliding + mamba2 model with a byte-level
tokenizer, so that everything runs offline. Its weights are trained on the recall task
(`hyrax train-demo`, hyrax/tasks/, docs/demo-model.md); this module holds its config and
tokenizer."""
from __future__ import annotations

import json
from pathlib import Path

from hyrax.actors.model.config import ModelConfig

DEMO_DIR = Path(__file__).resolve().parents[2] / "models" / "demo"
EOS, PAD, BOS = 256, 257, 258
SPECIALS = {"<|eos|>": EOS, "<|pad|>": PAD, "<|bos|>": BOS}

# The shipped weights are trained on hyrax.tasks.recall (`hyrax train-demo`, docs/demo-model.md);
# that task's delay line is sized against this sliding window and layer order.
DEMO_CONFIG = ModelConfig(
    vocab_size=264, hidden_size=128, intermediate_size=256,
    layer_types=("mamba2", "sliding_attention", "mamba2", "full_attention", "mamba2", "sliding_attention"),
    num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    mamba_n_heads=8, mamba_d_head=32, mamba_d_state=32, mamba_n_groups=2, mamba_d_conv=4, mamba_chunk_size=32,
    sliding_window=8, max_position_embeddings=2048, tie_word_embeddings=True,
    bos_token_id=BOS, eos_token_id=(EOS,), pad_token_id=PAD,
)


def resolve_model_path(name: str) -> Path:
    """`demo` names the shipped checkpoint; an existing directory is itself; `org/name[@rev]`
    is looked up in the local Hugging Face cache (hub_cache.py); anything else is returned as
    a path for ModelConfig.from_dir to refuse."""
    from hyrax.actors.model.hub_cache import looks_like_repo_id, snapshot_dir
    from hyrax.env import hf_hub_cache

    if name == "demo":
        return DEMO_DIR
    if Path(name).is_dir() or not looks_like_repo_id(name):
        return Path(name)
    return snapshot_dir(name, hf_hub_cache())


def default_served_name(name: str) -> str:
    """The model name clients see when --served-model-name is not given (for a `--model` that
    resolved): `hyrax-demo`, a directory's name, or the repo id without its @revision."""
    if name == "demo":
        return "hyrax-demo"
    return Path(name).resolve().name if Path(name).is_dir() else name.partition("@")[0]


def _byte_chars() -> list[str]:
    """Byte-level alphabet: printable bytes stand for themselves, the rest are shifted past 255."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, shift = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + shift))
            shift += 1
    return chars


def byte_level_tokenizer_json() -> dict:
    """A tokenizer.json with one token per byte (ids 0..255 = byte values) plus specials."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {ch: b for b, ch in enumerate(_byte_chars())}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    from tokenizers import AddedToken

    for text in SPECIALS:  # added in id order 256, 257, 258
        tok.add_special_tokens([AddedToken(text, special=True)])
    return json.loads(tok.to_str())


CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def write_tokenizer(path: Path) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "tokenizer.json").write_text(json.dumps(byte_level_tokenizer_json()))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|eos|>", "pad_token": "<|pad|>", "bos_token": "<|bos|>", "chat_template": CHAT_TEMPLATE,
    }, indent=2))
