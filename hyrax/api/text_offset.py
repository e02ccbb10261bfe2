"""Where each token of a completion starts in its text: the completions API's `text_offset`.

A token's offset is read as it is fed to the choice's text stream (streamed and whole answers
alike), by one rule:

- a token fed while the text ends inside a character (bytes that more bytes can still finish)
  and that continues that character (adds to it, finishes it, or writes no bytes at all: a
  special token) starts where that character does, as the token that began it;
- any other token starts where the text before it and the text after it part.

Decoders write an unfinished character as one U+FFFD (byte-level BPE, the byte tokenizer) or one
per byte (byte fallback), and an invalid byte as a U+FFFD of its own, so the text alone cannot
tell a byte that continues a character from one that breaks it off; the tokens' bytes do. A
character that a later byte breaks off (it becomes an invalid sequence's U+FFFD) keeps the
offsets already given: a token that wrote nothing inside it stays at its start.
"""
from __future__ import annotations

import codecs
import os

from hyrax.api.text import TextStream


def unsettled(text: TextStream, end: int | None = None) -> str:
    """The text of the ids fed to `text` after its settled part (`text.text`), up to `end`: empty,
    or ending inside a character (U+FFFD, which the next token completes, continues, or shows to
    be an invalid byte's, that stays in the text)."""
    if text.read == (len(text.ids) if end is None else min(end, len(text.ids))):  # (no copy of the ids: per token)
        return ""
    return text.decode(text.ids[text.prefix:end])[len(text.decode(text.ids[text.prefix:text.read])):]


def unfinished_character(pieces: list[bytes]) -> tuple[bytes, int]:
    """The bytes of the character that `pieces` (tokens' bytes, in order) end inside (b"" if they
    end between characters), and the index of the piece holding its first byte."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    decoder.decode(b"".join(pieces))
    pending = decoder.getstate()[0]
    left, first = len(pending), len(pieces)
    while left > 0:
        first -= 1
        left -= len(pieces[first])
    return pending, first


def continues(pending: bytes, data: bytes) -> bool:
    """Whether bytes `data` written after the unfinished character `pending` go on with it (no
    bytes stay inside it), rather than break it off."""
    if not data:
        return True
    try:
        (pending + data[:1]).decode("utf-8")
    except UnicodeDecodeError as e:
        return e.reason == "unexpected end of data"  # still unfinished, not invalid
    return True


def feed_with_offset(text: TextStream, tok, token: int) -> int:
    """Feed `token` to `text` (a stream without stop strings) and return its offset in the
    completion's text. `tok`: the tokenizer (its `token_bytes`)."""
    settled, before = len(text.text), unsettled(text)
    pending, first = unfinished_character([tok.token_bytes(i) for i in text.ids[text.read:]])
    start = None
    if pending and continues(pending, tok.token_bytes(token)):
        # the token that began the character wrote it as one U+FFFD at the end of its text
        start = settled + len(unsettled(text, text.read + first + 1)) - 1
    text.feed([token])
    if start is not None:
        return start
    after = text.text[settled:] + unsettled(text)
    return settled + len(os.path.commonprefix([before, after]))
