"""The gateway's incremental detokenizer (issue 21): fed a token stream in any pieces, its
deltas concatenate to exactly the text a whole decode gives, with stop strings cut where the
whole text first contains one — and it decodes each id a bounded number of times, so a
long answer costs the same per token as a short one (the old TextStream decoded the whole
answer on every feed: quadratic in its length)."""
from __future__ import annotations

import random
from pathlib import Path

import pytest

from hyrax.actors.model.tokenizer import load_tokenizer
from hyrax.api.text import TextStream

DEMO = Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo"


def _whole(decode, ids: list[int], stop: tuple[str, ...]) -> str:
    """What a client must see: the whole decode, cut before the first stop string."""
    text = decode(ids)
    cuts = [text.find(s) for s in stop if s and s in text]
    return text[: min(cuts)] if cuts else text


def _pieces(ids: list[int], rng: random.Random) -> list[list[int]]:
    out, k = [], 0
    while k < len(ids):
        n = rng.choice([1, 1, 1, 2, 3, 7])
        out.append(ids[k:k + n])
        k += n
    return out


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(DEMO, 264)


TEXTS = ["Hello, world! Ünïcödé and emoji 🦔🦔 — mixed\nlines\tand tabs.", "stop here STOP and after", "ab" * 50,
         "aaaaaaaaSTO", "日本語のテキスト、そして English.", "x STOP"]


@pytest.mark.parametrize("stop", [(), ("STOP",), ("a", "xyz"), ("🦔",), ("e a", "ab a")])
def test_deltas_equal_the_whole_decode_for_any_pieces(tok, stop):
    rng = random.Random(1)
    for text in TEXTS:
        ids = tok.encode(text)
        for _ in range(5):
            s = TextStream(tok.decode, stop)
            deltas = [s.feed(p) for p in _pieces(ids, rng)] + [s.finish()]
            assert "".join(deltas) == _whole(tok.decode, ids, stop) == s.emitted, (text, stop)


def test_invalid_byte_runs_are_held_then_flushed_at_the_end(tok):
    ids = tok.encode("ok ") + [0xF0, 0x9F] + tok.encode(" tail") + [0xE2]  # broken UTF-8 in the middle and the end
    s = TextStream(tok.decode)
    deltas = [s.feed([i]) for i in ids] + [s.finish()]
    assert "".join(deltas) == tok.decode(ids)
    assert not any(d.endswith("\ufffd") for d in deltas[:-1] if d), deltas  # never an incomplete character early


def test_each_id_is_decoded_a_bounded_number_of_times(tok):
    ids = tok.encode("The hedgehog walks on. " * 120)  # ~2,800 tokens
    decoded = []

    def counting(xs):
        decoded.append(len(xs))
        return tok.decode(xs)

    s = TextStream(counting, ("never appears",))
    for i in ids:
        s.feed([i])
    s.finish()
    assert s.emitted == tok.decode(ids)
    assert sum(decoded) <= 8 * len(ids), f"{sum(decoded)} ids decoded for {len(ids)} tokens"
