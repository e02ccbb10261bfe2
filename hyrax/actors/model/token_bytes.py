"""The most bytes of input text one token of a `tokenizer.json` tokenizer can stand for, so that
UTF-8 bytes / that is a lower bound on a text's token count, known without tokenizing it (the
gateway refuses a multi-megabyte prompt over the context at once with it).

The bound holds only where nothing the pipeline does can make a token cover more input than its
vocabulary string is long; anything else answers None (no bound, the text is tokenized):

- the model is BPE, and every input has a token: byte-level (all 256 byte characters in the
  vocabulary, a ByteLevel pre-tokenizer), byte fallback (all 256 `<0xXX>` tokens), or one unknown
  token per unknown character (`fuse_unk` off: a character is at most 4 bytes);
- a token's string is at least as long in UTF-8 as the input it covers: a byte-level character
  stands for one byte (and is 1 or 2 in UTF-8), Metaspace's ▁ for a space (3 for 1), `<0x41>`
  for one byte, an added token for its own content;
- no added token strips the whitespace beside it (`lstrip`/`rstrip` take any amount of it);
- no truncation, and no pre-tokenizer step that drops text (Whitespace, BERT's, a Split or
  Punctuation that removes what it matched);
- the normalizer shrinks text by a known factor at most, which multiplies the bound: Unicode
  normalization and lowercasing turn one code point (up to 4 bytes) into at least one byte, and
  a composition into at least a quarter of its bytes, hence 4; `Replace` of a fixed string by a
  non-empty one by the ratio of their lengths; `Prepend` adds. Strip, StripAccents, BERT's
  normalizer, a Precompiled (SentencePiece) map or a Replace by a regex can drop text: no bound.
"""
from __future__ import annotations

KEEPS_TEXT = {"ByteLevel", "Metaspace", "Digits", "UnicodeScripts", "Split", "Punctuation"}  # pre-tokenizers
UNICODE_FORMS = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase"}
SHRINKS_AT_MOST = 4  # a Unicode normalization or lowercasing: see above


def _shrink(normalizer: dict | None) -> float | None:
    """How many times fewer UTF-8 bytes the normalizer can leave than it was given; None: unknown."""
    if normalizer is None:
        return 1.0
    kind = normalizer.get("type")
    if kind == "Sequence":
        out = 1.0
        for n in normalizer.get("normalizers", []):
            f = _shrink(n)
            if f is None:
                return None
            out *= f
        return out
    if kind in UNICODE_FORMS:
        return float(SHRINKS_AT_MOST)
    if kind == "Prepend":
        return 1.0
    if kind == "Replace":
        pattern, content = normalizer.get("pattern", {}), normalizer.get("content", "")
        if "String" not in pattern or not content or not pattern["String"]:
            return None
        return max(1.0, len(pattern["String"].encode("utf-8")) / len(content.encode("utf-8")))
    return None


def _keeps_text(pre: dict | None) -> bool:
    """Whether the pre-tokenizer hands on every byte of its input (it may add, never drop)."""
    if pre is None:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre.get("pretokenizers", []))
    return kind in KEEPS_TEXT and pre.get("behavior") != "Removed"


def _kinds(pre: dict | None) -> set[str]:
    if pre is None:
        return set()
    if pre.get("type") == "Sequence":
        return set().union(*(_kinds(p) for p in pre.get("pretokenizers", [])))
    return {pre.get("type")}


def _every_input_has_a_token(model: dict, pre: dict | None) -> tuple[bool, int]:
    """(whether no input text is lost or fused into one unknown token, the bytes one unknown token covers)."""
    vocab = model.get("vocab") or {}
    if model.get("byte_fallback") and all(f"<0x{b:02X}>" in vocab for b in range(256)):
        return True, 0
    if "ByteLevel" in _kinds(pre) and all(c in vocab for c in _byte_level_alphabet()):
        return True, 0
    if model.get("unk_token") in vocab and not model.get("fuse_unk"):
        return True, 4  # one unknown character: at most 4 bytes of UTF-8
    return False, 0


def _byte_level_alphabet() -> list[str]:
    """The 256 characters that the ByteLevel pre-tokenizer maps bytes to."""
    from tokenizers.pre_tokenizers import ByteLevel

    return ByteLevel.alphabet()


def max_bytes_per_token(spec: dict) -> float | None:
    """`spec`: a parsed tokenizer.json. The most UTF-8 bytes of input one token covers, or None
    when this tokenizer gives no such bound (module docstring)."""
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer")
    if model.get("type") != "BPE" or spec.get("truncation") is not None or not _keeps_text(pre):
        return None
    added = spec.get("added_tokens") or []
    if any(t.get("lstrip") or t.get("rstrip") for t in added):
        return None
    complete, unknown = _every_input_has_a_token(model, pre)
    shrink = _shrink(spec.get("normalizer"))
    if not complete or shrink is None:
        return None
    strings = [*(model.get("vocab") or {}), *(t.get("content", "") for t in added)]
    longest = max([unknown, 1, *(len(s.encode("utf-8")) for s in strings)])
    return longest * shrink
