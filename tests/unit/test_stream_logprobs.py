"""A streamed answer reports the same logprobs as the whole answer: every token's entry once, in
order, with the same values (the completions route's `text_offset` counts from the start of the
completion in both). The gateway runs over a scripted replica, so no engine is needed."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from hyrax.actors.model.tokenizer import ByteTokenizer, load_tokenizer
from hyrax.api.app import GatewaySettings, create_app
from hyrax.api.client import EngineClient, ModelInfo
from hyrax.api.text import TextStream
from hyrax.api.text_offset import feed_with_offset

EOS = 256


class ScriptedReplica:
    """A replica whose every request streams `items`, one engine item each."""

    role, index = "colocated", 0

    def __init__(self, items: list[dict]):
        self.items = items

    def generate(self, request_id, prompt_ids, params):
        async def stream():
            for item in self.items:
                yield dict(item)
        return stream()

    async def health(self) -> dict:
        return {"role": self.role, "replica": self.index, "healthy": True, "stuck": None}


def _items(tokens: list[int], reason: str) -> list[dict]:
    """One engine item per token, each with a distinct logprob entry."""
    return [{"token_ids": [t], "finished": i == len(tokens) - 1, "finish_reason": reason if i == len(tokens) - 1 else None,
             "logprobs": [{"logprob": -0.1 * (i + 1), "top": [[t, -0.1 * (i + 1)]]}]} for i, t in enumerate(tokens)]


def _scripted(items: list[dict]) -> TestClient:
    client = EngineClient(ModelInfo("m", 2048, ByteTokenizer(264, EOS), None, 264, (EOS,)), [ScriptedReplica(items)])
    app = create_app(client, GatewaySettings(admin_token="t"))
    app.state.ready = True
    return TestClient(app)


@pytest.fixture
def gateway():
    def make(tokens: list[int], reason: str = "stop") -> TestClient:
        return _scripted(_items(tokens, reason))
    return make


def _events(text: str) -> list[dict]:
    return [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")]


# "hello" then EOS (decodes to nothing); "hel" then "lo" where "lo" is a stop string (held back, then cut)
ANSWERS = [([*b"hello", EOS], {}), ([*b"hello"], {"stop": "lo"})]


@pytest.mark.parametrize("tokens,extra", ANSWERS)
def test_a_streamed_chat_answer_reports_every_tokens_logprob_as_the_whole_answer_does(gateway, tokens, extra):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1,
            **extra}
    http = gateway(tokens)
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    streamed = [e for ev in _events(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
                for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert len(whole) == len(tokens)
    assert streamed == whole


@pytest.mark.parametrize("tokens,extra", ANSWERS)
def test_a_streamed_completions_answer_reports_the_whole_answers_logprobs_and_text_offsets(gateway, tokens, extra):
    body = {"model": "m", "prompt": "hi", "logprobs": 1, **extra}
    whole, joined = _both(gateway(tokens), body)
    assert whole["text_offset"] == [0, 1, 2, 3, 4, 5][:len(tokens)]
    assert joined == whole


def _both(http: TestClient, body: dict) -> tuple[dict, dict]:
    """The completions answer's logprobs, whole and joined from its stream."""
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    joined = {k: [] for k in whole}
    for ev in _events(http.post("/v1/completions", json={**body, "stream": True}).text):
        for c in ev["choices"]:
            for k in joined:
                joined[k] += (c["logprobs"] or {}).get(k, [])
    return whole, joined


# "éa日b": é and 日 are 2 and 3 bytes, one token each byte (the byte tokenizer, as the demo model's)
MULTIBYTE = [*"é".encode(), ord("a"), *"日".encode(), ord("b")]


def test_completions_text_offsets_index_the_text_across_characters_split_over_tokens():
    """OpenAI's text_offset is where each token starts in the completion's text. A token that is
    part of a character decodes alone to U+FFFD; counting that as a character put every token
    after 'é' one character late ([0, 1, 2, 3, 4, 5, 6] for a 4-character text)."""
    http = _scripted(_items(MULTIBYTE, "length"))
    whole, joined = _both(http, {"model": "m", "prompt": "hi", "logprobs": 1})
    text = http.post("/v1/completions", json={"model": "m", "prompt": "hi"}).json()["choices"][0]["text"]
    assert text == "éa日b"
    assert whole["text_offset"] == [0, 0, 1, 2, 2, 2, 3]
    assert joined == whole


def test_completions_top_logprobs_keep_the_most_likely_of_tokens_that_read_the_same():
    """top_logprobs maps each token's text to its logprob; tokens that decode to the same text
    (bytes of a character, each alone U+FFFD) share one key, which must hold the most likely
    one's logprob, not whichever came last (the least likely)."""
    top = [[0xC3, -0.1], [0xC4, -0.2], [0xC5, -0.9]]
    items = [{"token_ids": [t], "finished": i == 1, "finish_reason": "length" if i == 1 else None,
              "logprobs": [{"logprob": -0.1, "top": top}]} for i, t in enumerate("é".encode())]
    whole, joined = _both(_scripted(items), {"model": "m", "prompt": "hi", "logprobs": 3})
    assert whole["top_logprobs"] == [{"\ufffd": -0.1}, {"\ufffd": -0.1}]
    assert joined == whole


def test_chat_logprob_bytes_are_each_tokens_own_bytes_and_join_into_the_text():
    """OpenAI's `bytes` is what lets a client put back a character split over tokens: each
    token's own UTF-8 bytes. A token inside a character decodes alone to U+FFFD, whose bytes
    ([239, 191, 189]) were reported instead."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 1}
    http = _scripted(_items(MULTIBYTE, "length"))
    whole = http.post("/v1/chat/completions", json=body).json()["choices"][0]
    content = whole["logprobs"]["content"]
    assert [e["bytes"] for e in content] == [[b] for b in MULTIBYTE]
    assert [e["top_logprobs"][0]["bytes"] for e in content] == [[b] for b in MULTIBYTE]
    assert bytes(b for e in content for b in e["bytes"]).decode() == whole["message"]["content"] == "éa日b"
    streamed = [e for ev in _events(http.post("/v1/chat/completions", json={**body, "stream": True}).text)
                for c in ev["choices"] if c.get("logprobs") for e in c["logprobs"]["content"]]
    assert streamed == content


def test_a_tokenizer_json_tokens_bytes_join_into_the_text():
    """The demo checkpoint's byte-level BPE: every token of a text with characters of 2, 3 and 4
    bytes gives its own bytes, and they join into the text's UTF-8."""
    from pathlib import Path

    from hyrax.actors.model.tokenizer import load_tokenizer

    tok = load_tokenizer(Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo", 256)
    text = "naïve 日本 😀 end"
    ids = tok.encode(text)
    assert any("\ufffd" in tok.decode([t]) for t in ids)  # some token is part of a character
    assert b"".join(tok.token_bytes(t) for t in ids) == text.encode()


def _hot_items() -> list[dict]:
    """'ab' sampled hot: 'a' is less likely than both top alternatives the engine reports, 'b'
    is the second (its own logprob comes separately, as the engine reports it)."""
    tops = [[[ord("x"), -0.2], [ord("y"), -1.5]], [[ord("x"), -0.3], [ord("b"), -4.0]]]
    return [{"token_ids": [t], "finished": i == 1, "finish_reason": "length" if i == 1 else None,
             "logprobs": [{"logprob": lp, "top": top}]}
            for i, (t, lp, top) in enumerate(zip(b"ab", (-3.0, -4.0), tops))]


@pytest.mark.parametrize("n", [0, 2])
def test_completions_top_logprobs_always_hold_the_sampled_token(n):
    """OpenAI's legacy completions (and vLLM): "the API will always return the logprob of the
    sampled token, so there may be up to logprobs+1 elements". A token sampled outside the top
    N was missing from its own top_logprobs, and logprobs: 0 gave {} at every position."""
    items = _hot_items()
    for it in items:  # the engine reports the top n
        it["logprobs"][0]["top"] = it["logprobs"][0]["top"][:n]
    whole, joined = _both(_scripted(items), {"model": "m", "prompt": "hi", "logprobs": n})
    assert whole["tokens"] == ["a", "b"] and whole["token_logprobs"] == [-3.0, -4.0]
    if n == 0:
        assert whole["top_logprobs"] == [{"a": -3.0}, {"b": -4.0}]
    else:  # the top 2, then the sampled token where it is not among them
        assert whole["top_logprobs"] == [{"x": -0.2, "y": -1.5, "a": -3.0}, {"x": -0.3, "b": -4.0}]
        assert list(whole["top_logprobs"][0]) == ["x", "y", "a"]
    assert joined == whole


def test_chat_top_logprobs_are_exactly_the_top_alternatives():
    """Chat is OpenAI's other format: top_logprobs holds exactly top_logprobs alternatives, and
    the sampled token is the entry's own token and logprob (not added to its alternatives)."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    answer = _scripted(_hot_items()).post("/v1/chat/completions", json=body).json()
    content = answer["choices"][0]["logprobs"]["content"]
    assert [(e["token"], e["logprob"]) for e in content] == [("a", -3.0), ("b", -4.0)]
    assert [[a["token"] for a in e["top_logprobs"]] for e in content] == [["x", "y"], ["x", "b"]]


# 0xFF is no UTF-8 byte (the text reads U+FFFD for it); 0xE6 0x97 begin '日' and 0xFF breaks it off
INVALID = [([0xFF, *b"ab"], "\ufffdab", [0, 1, 2]),
           ([*b"a", 0xFF, 0xE6, *b"b"], "a\ufffd\ufffdb", [0, 1, 2, 3]),
           ([0xFF, 0xE6, 0x97, 0xA5, *b"b"], "\ufffd日b", [0, 1, 1, 1, 2]),
           ([0xE6, 0x97, 0xFF, *b"b"], "\ufffd\ufffdb", [0, 0, 1, 2])]


@pytest.mark.parametrize("tokens,text,offsets", INVALID)
def test_completions_text_offsets_count_an_invalid_bytes_replacement_character(tokens, text, offsets):
    """A byte that begins no character reads U+FFFD in the text, which the token after it
    follows: its offset was one character early for each such byte ('\\ufffdab': [0, 0, 1]),
    as the U+FFFD was counted only once the next token showed it was no character's start."""
    http = _scripted(_items(tokens, "length"))
    assert http.post("/v1/completions", json={"model": "m", "prompt": "hi"}).json()["choices"][0]["text"] == text
    whole, joined = _both(http, {"model": "m", "prompt": "hi", "logprobs": 1})
    assert whole["text_offset"] == offsets
    assert joined == whole


def _sentencepiece_style(tmp_path, decoder: str):
    """A tiny tokenizer.json as SentencePiece-converted checkpoints ship (Llama 2, Mistral, ...):
    '▁' marks a space, '<0xXX>' pieces are bytes; decoding drops the first token's leading
    space. `decoder`: "llama" (Replace, ByteFallback, Fuse, Strip) or "metaspace"."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from hyrax.actors.model.tokenizer import load_tokenizer

    vocab = {"<unk>": 0, "</s>": 1, **{f"<0x{b:02X}>": 2 + b for b in range(256)}}
    for piece in ("▁Hello", "▁world", "world", "▁", "!"):
        vocab[piece] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first") if decoder == "metaspace" else \
        decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                           decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["</s>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    return load_tokenizer(tmp_path, len(vocab) + 1), vocab


@pytest.mark.parametrize("decoder", ["llama", "metaspace"])
def test_sentencepiece_tokens_keep_their_leading_space_in_logprobs(tmp_path, decoder):
    """A SentencePiece token decoded alone loses its leading space ('▁world' reads 'world', as
    the first token of a text does), so logprob tokens read 'world' where the text has ' world',
    and '▁world' and 'world' shared one top_logprobs key. Each now reads its own piece with the
    space (as vLLM reports logprob tokens): the completions tokens and keys, chat's token and bytes."""
    tok, vocab = _sentencepiece_style(tmp_path, decoder)
    ids = [vocab["▁Hello"], vocab["▁world"], vocab["!"]]
    tops = [[[ids[0], -0.1]], [[ids[1], -0.2], [vocab["world"], -0.3]], [[ids[2], -0.4], [vocab["▁"], -0.5]]]
    items = [{"token_ids": [t], "finished": i == 2, "finish_reason": "length" if i == 2 else None,
              "logprobs": [{"logprob": top[0][1], "top": top}]} for i, (t, top) in enumerate(zip(ids, tops))]
    client = EngineClient(ModelInfo("m", 2048, tok, None, tok.vocab_size, (1,)), [ScriptedReplica(items)])
    app = create_app(client, GatewaySettings(admin_token="t"))
    app.state.ready = True
    http = TestClient(app)

    whole, joined = _both(http, {"model": "m", "prompt": "hi", "logprobs": 2})
    # the answer is decoded after the prompt (TextStream.after_prompt): its first token keeps its space too
    assert http.post("/v1/completions", json={"model": "m", "prompt": "hi"}).json()["choices"][0]["text"] \
        == " Hello world!"
    assert whole["tokens"] == [" Hello", " world", "!"]
    assert whole["top_logprobs"] == [{" Hello": -0.1}, {" world": -0.2, "world": -0.3}, {"!": -0.4, " ": -0.5}]
    assert whole["text_offset"] == [0, 6, 12]
    assert joined == whole

    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 2}
    content = http.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    assert [e["token"] for e in content] == [" Hello", " world", "!"]
    assert [bytes(e["bytes"]) for e in content] == [b" Hello", b" world", b"!"]
    assert [[a["token"] for a in e["top_logprobs"]] for e in content][1:] == [[" world", "world"], ["!", " "]]
    if decoder == "llama":  # a byte piece (a Metaspace decoder alone writes none)
        assert tok.token_text(vocab["<0xE6>"]) == "\ufffd" and tok.token_bytes(vocab["<0xE6>"]) == b"\xe6"
    assert tok.token_text(1) == "" and tok.token_bytes(1) == b""  # a special token


def _offsets_of(tok, tokens: list[int], text: str) -> dict:
    """The completions logprobs of an answer of `tokens` (whose text is `text`), whole; checked
    to be the same joined from the stream."""
    client = EngineClient(ModelInfo("m", 2048, tok, None, tok.vocab_size), [ScriptedReplica(_items(tokens, "length"))])
    app = create_app(client, GatewaySettings(admin_token="t"))
    app.state.ready = True
    http = TestClient(app)
    assert http.post("/v1/completions", json={"model": "m", "prompt": "hi"}).json()["choices"][0]["text"] == text
    whole, joined = _both(http, {"model": "m", "prompt": "hi", "logprobs": 1})
    assert joined == whole
    return whole["text_offset"]


def _zero_byte_answers(tmp_path) -> list[tuple[object, list[int], str, list[int]]]:
    """(tokenizer, answer, its text, text_offset) for answers with a token that writes no bytes (a
    special token) inside a character: the byte tokenizer, the demo's byte-level BPE, and a
    tokenizer.json whose bytes are '<0xXX>' pieces (ByteFallback)."""
    tok, vocab = _sentencepiece_style(tmp_path, "llama")
    demo = load_tokenizer(Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo", 259)
    special, hi = vocab["</s>"], [vocab[f"<0x{b:02X}>"] for b in "日".encode()]
    byte = ByteTokenizer(264, EOS)
    return [(byte, [0xE6, 0x97, 257, 0xA5, ord("b")], "日b", [0, 0, 0, 0, 1]),
            (byte, [0xE6, 257, 0x97, 0xA5, ord("b")], "日b", [0, 0, 0, 0, 1]),
            # an invalid byte's U+FFFD is a whole character: what follows it, written or not, comes after it
            (byte, [0xFF, 257, ord("a")], "\ufffda", [0, 1, 1]),
            (byte, [0xE6, 0xFF, 257, ord("a")], "\ufffd\ufffda", [0, 1, 2, 2]),
            (demo, [*demo.encode("a日")[:3], 257, *demo.encode("日b")[2:]], "a日b", [0, 1, 1, 1, 1, 2]),
            (tok, [hi[0], hi[1], special, hi[2], vocab["!"]], "日!", [0, 0, 0, 0, 1])]


def test_a_token_writing_no_bytes_inside_a_character_starts_where_that_character_does(tmp_path):
    """A token that writes nothing (a special token) while the text ends inside a character sits
    inside that character, so its text_offset is the character's start, as the bytes around it
    have. It was counted past the character's U+FFFD, after the tokens that follow it
    ([0, 0, 1, 0, 1] for '日b' with a special token after its second byte)."""
    for tok, tokens, text, offsets in _zero_byte_answers(tmp_path):
        assert (tokens, _offsets_of(tok, tokens, text)) == (tokens, offsets)


def test_byte_fallback_pieces_of_one_character_all_start_where_it_does(tmp_path):
    """A '<0xXX>' byte-fallback decoder writes one U+FFFD per byte of an unfinished character, so
    a byte that continues one reads as a character more (as an invalid byte would): its offset
    was one past the character's start ([0, 1, 0, 1] for '日!'). The tokens' bytes tell them apart."""
    tok, vocab = _sentencepiece_style(tmp_path, "llama")
    tokens = [*(vocab[f"<0x{b:02X}>"] for b in "日".encode()), vocab["!"]]
    assert _offsets_of(tok, tokens, "日!") == [0, 0, 0, 1]
    breaks = [vocab["<0xE6>"], vocab["<0x97>"], vocab["<0xFF>"], vocab["!"]]  # 0xFF breaks the character off
    assert _offsets_of(tok, breaks, "\ufffd\ufffd\ufffd!") == [0, 0, 2, 3]


def test_text_offsets_never_go_back_over_bytes_and_special_tokens_in_any_order():
    """Over answers of bytes that begin, continue and break off characters, with special tokens
    (no bytes) anywhere: each token starts no earlier than the one before it, and within the text."""
    import random

    rng = random.Random(0)
    pool = [0xE6, 0x97, 0xA5, 0xC3, 0xA9, 0xF0, 0x9F, 0xFF, ord("a"), 257]
    for _ in range(100):
        tokens = [rng.choice(pool) for _ in range(rng.randint(1, 10))]
        http = _scripted(_items(tokens, "length"))
        choice = http.post("/v1/completions", json={"model": "m", "prompt": "hi", "logprobs": 0}).json()["choices"][0]
        offsets = choice["logprobs"]["text_offset"]
        assert offsets == sorted(offsets) and offsets[-1] <= len(choice["text"]), (tokens, offsets)


class _CountedIds(list):
    """A TextStream's ids that count the ids each slice of them copies."""

    copied = 0

    def __getitem__(self, i):
        got = super().__getitem__(i)
        if isinstance(i, slice):
            self.copied += len(got)
        return got


def test_a_tokens_text_offset_reads_the_same_few_ids_however_long_the_answer():
    """text_offset is read per token, on the answer's stream: each token's work reads the ids of
    the character it may sit in, not the whole answer. Before, every token copied all the ids so
    far (a long answer's offsets cost time quadratic in its length: 32k tokens ~1.9 s, the text
    itself 0.2 s); the whole answer's offsets now copy a few ids per token."""
    tok = ByteTokenizer(264, EOS)
    tokens = tok.encode("abc d\u00e9f \u65e5\u672c " * 200)
    text = TextStream.after_prompt(tok.decode, tok.encode("hi"))
    text.ids = _CountedIds()
    offsets = [feed_with_offset(text, tok, t) for t in tokens]
    assert text.text == tok.decode(tokens) and offsets == sorted(offsets)
    assert text.ids.copied <= 20 * len(tokens), (text.ids.copied, len(tokens))
