"""Tokenizer: `tokenizer.json` through the `tokenizers` library, or a byte-level fallback
for checkpoints without one (ids 0..255 are bytes; specials follow).

Fidelity with transformers:
- plain text is encoded with the special tokens the checkpoint adds (tokenizer.json's
  post-processor, plus BOS when tokenizer_config.json says `add_bos_token`), as
  `tokenizer(text)` does;
- a rendered chat prompt (`ChatPrompt`, from `hyrax.api.text.render_chat`) already holds its
  special tokens and is encoded without adding any, as `apply_chat_template` does;
- decoding skips special tokens;
- `chat_template` returns the template together with the checkpoint's named special-token
  strings (bos_token, eos_token, pad_token, ...), which the template is rendered with.
"""
from __future__ import annotations

import functools
import json
import re
from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.token_bytes import max_bytes_per_token


class ByteTokenizer:
    """UTF-8 bytes as ids; invalid sequences decode with replacement characters."""

    # the most bytes of input text one token stands for (token_bytes.py): one, exactly
    max_bytes_per_token = 1

    def __init__(self, vocab_size: int, eos_token_id: int | None = None):
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: list[int]) -> str:
        return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")

    def token_text(self, token_id: int) -> str:
        """The text one token writes (a byte that is part of a character: U+FFFD)."""
        return self.decode([token_id])

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for in decoded text (a special token: none)."""
        return bytes([token_id]) if 0 <= token_id < 256 else b""


class ChatPrompt(str):
    """Text rendered from a chat template: it carries its own special tokens."""


class ChatTemplate(str):
    """A checkpoint's Jinja chat template, with the named special-token strings it is rendered
    with (`special_tokens`: bos_token, eos_token, unk_token, ... as transformers'
    `special_tokens_map`, only those the tokenizer has) and, when tokenizer_config.json names
    one, the "tool_use" template that transformers renders instead when tools are given."""

    bos_token: str = ""
    eos_token: str = ""

    def __new__(cls, template: str, bos_token: str = "", eos_token: str = "", tool_use: str | None = None,
                **special_tokens: str):
        obj = super().__new__(cls, template)
        obj.bos_token, obj.eos_token, obj.tool_use = bos_token, eos_token, tool_use
        named = {"bos_token": bos_token, "eos_token": eos_token, **special_tokens}
        obj.special_tokens = {k: v for k, v in named.items() if v}
        return obj

    def __reduce__(self):  # crosses Ray's object store with its tokens
        return _chat_template, (str(self), self.tool_use, self.special_tokens)


def _chat_template(template: str, tool_use: str | None, special_tokens: dict) -> ChatTemplate:
    return ChatTemplate(template, tool_use=tool_use, **special_tokens)


# transformers' SPECIAL_TOKENS_ATTRIBUTES: the named special tokens a chat template sees.
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(v) -> str:
    """tokenizer_config.json spells a special token as a string or as {"content": ...}."""
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return v if isinstance(v, str) else ""


def _tokenizer_config(model_dir: Path) -> dict:
    f = model_dir / "tokenizer_config.json"
    if not f.is_file():
        return {}
    try:
        d = json.loads(f.read_text())
    except json.JSONDecodeError as e:
        raise HyraxInputError(f"{f} is not valid JSON: {e}") from None
    return d if isinstance(d, dict) else {}


class HFTokenizer:
    def __init__(self, path: Path):
        from tokenizers import Tokenizer

        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # the tokenizers library raises its own exception types
            raise HyraxInputError(f"cannot read {path}: {e}") from None
        self.vocab_size = self._tok.get_vocab_size()
        tc = _tokenizer_config(path.parent)
        bos = _token_str(tc.get("bos_token"))
        self.bos_token_id = self._tok.token_to_id(bos) if bos else None
        self.add_bos = bool(tc.get("add_bos_token", False)) and self.bos_token_id is not None

    def encode(self, text: str) -> list[int]:
        """Through `encode_batch`, which lets go of the GIL while it works (`encode` holds it:
        seconds for a long prompt, during which no other thread of the process runs)."""
        if isinstance(text, ChatPrompt):
            return self._tok.encode_batch([text], add_special_tokens=False)[0].ids
        ids = self._tok.encode_batch([text], add_special_tokens=True)[0].ids
        if self.add_bos and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """The text one token writes where it does not start the text: its decoding alone, with
        what the decoder strips from a text's first token put back (SentencePiece's space:
        '▁world' alone reads 'world', after another token ' world'), as vLLM reports logprob
        tokens. Read as the decoder writes the piece after another one; a special token: ''."""
        alone = self.decode([token_id])
        piece, decoder = self._tok.id_to_token(token_id), self._decoder
        if piece is None or decoder is None or token_id in self._special_ids:
            return alone
        after = decoder.decode([_ANCHOR, piece])[self._anchor_chars:]
        return after if after.endswith(alone) else alone  # only ever a stripped prefix put back

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes one token stands for in decoded text: its `token_text`, unless that
        holds U+FFFD (the token is part of a character), then its vocabulary piece read as the
        decoder writes bytes (a byte-level character each, or a `<0xXX>` byte-fallback token)."""
        text = self.token_text(token_id)
        if "\ufffd" not in text:
            return text.encode("utf-8")
        raw = _piece_bytes(self._tok.id_to_token(token_id) or "", self._byte_pieces)
        return text.encode("utf-8") if raw is None else raw

    @functools.cached_property
    def _decoder(self):
        return self._tok.decoder

    @functools.cached_property
    def _anchor_chars(self) -> int:
        return len(self._decoder.decode([_ANCHOR]))

    @functools.cached_property
    def _special_ids(self) -> frozenset[int]:
        """Ids of special tokens, which decoding skips."""
        return frozenset(i for i, t in self._tok.get_added_tokens_decoder().items() if t.special)

    @functools.cached_property
    def _byte_pieces(self) -> str | None:
        """How vocabulary pieces write bytes: "ByteLevel", "ByteFallback", or None (neither)."""
        decoder = json.loads(self._tok.to_str()).get("decoder") or {}
        kinds = {d.get("type") for d in decoder.get("decoders", [])} | {decoder.get("type")}
        return next((k for k in ("ByteLevel", "ByteFallback") if k in kinds), None)

    @functools.cached_property
    def max_bytes_per_token(self) -> float | None:
        """The most bytes of input text one token stands for, None when unknown (token_bytes.py)."""
        return max_bytes_per_token(json.loads(self._tok.to_str()))


def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level alphabet: the character each byte is written as in a byte-level BPE
    vocabulary (printable Latin-1 bytes as themselves, the others from U+0100 on, in order)."""
    printable = {*range(ord("!"), ord("~") + 1), *range(ord("\xa1"), ord("\xac") + 1), *range(ord("\xae"), 256)}
    others = (b for b in range(256) if b not in printable)
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


BYTE_LEVEL = _byte_level_alphabet()
_ANCHOR = "x"  # a plain piece put before a token, so the decoder does not read it as the text's first
_BYTE_FALLBACK = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _piece_bytes(piece: str, kind: str | None) -> bytes | None:
    """The bytes a vocabulary piece writes under a decoder of `kind` (see `_byte_pieces`); None
    when it writes none that way."""
    if kind == "ByteLevel" and piece and all(c in BYTE_LEVEL for c in piece):
        return bytes(BYTE_LEVEL[c] for c in piece)
    m = _BYTE_FALLBACK.fullmatch(piece) if kind == "ByteFallback" else None
    return bytes([int(m.group(1), 16)]) if m else None


def load_tokenizer(model_dir: str | Path, vocab_size: int):
    p = Path(model_dir)
    if (p / "tokenizer.json").is_file():
        return HFTokenizer(p / "tokenizer.json")
    return ByteTokenizer(vocab_size)


def chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The checkpoint's Jinja chat template (tokenizer_config.json, or chat_template.jinja next
    to it) with its bos/eos token strings; None when it has none."""
    p = Path(model_dir)
    try:
        tc = _tokenizer_config(p)
    except HyraxInputError:
        return None
    template = tc.get("chat_template")
    if template is None and (p / "chat_template.jinja").is_file():
        template = (p / "chat_template.jinja").read_text()
    tool_use = None
    if isinstance(template, list):  # named templates: "default", and "tool_use" when tools are given
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template, tool_use = named.get("default"), named.get("tool_use")
    if not isinstance(template, str):
        return None
    tokens = {k: _token_str(tc.get(k)) for k in SPECIAL_TOKEN_NAMES}
    return ChatTemplate(template, tool_use=tool_use if isinstance(tool_use, str) else None, **tokens)
