"""Tokenizer: `tokenizer.json` through the `tokenizers` library, or a byte-level fallback
for checkpoints without one (ids 0..255 are bytes; specials follow)."""
from __future__ import annotations

import json
from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError


class ByteTokenizer:
    """UTF-8 bytes as ids; invalid sequences decode with replacement characters."""

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise HyraxInputError(f"cannot read {path}: {e}") from None
        self.vocab_size = self._tok.get_vocab_size()

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


def load_tokenizer(model_dir: str | Path, vocab_size: int):
    p = Path(model_dir)
    if (p / "tokenizer.json").is_file():
        return HFTokenizer(p / "tokenizer.json")
    return ByteTokenizer(vocab_size)


def chat_template(model_dir: str | Path) -> str | None:
    """The checkpoint's Jinja chat template from tokenizer_config.json, if it has one."""
    f = Path(model_dir) / "tokenizer_config.json"
    if not f.is_file():
        return None
    try:
        return json.loads(f.read_text()).get("chat_template")
    except json.JSONDecodeError:
        return None
