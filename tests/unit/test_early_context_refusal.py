"""A multi-megabyte prompt over the context is refused at once, without tokenizing it: its UTF-8
length divided by the most bytes one token stands for (the tokenizer's `max_bytes_per_token`) is
a lower bound on its token count, and when that bound is already over what the context allows,
the answer is the 400 the exact count would give (`context_length_exceeded`, same param). A 4 MB
prompt cost the demo tokenizer seconds before that 400.

The bound must be a true lower bound, for the demo tokenizer and for tokenizers whose tokens are
long (merges of whitespace runs and repeated characters), that normalize, that fall back to bytes
or have added tokens: a property test compares it with the real count over random texts."""
from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway_fakes import EOS, Replica, gateway
from hyrax.actors.model.demo import DEMO_DIR
from hyrax.actors.model.token_bytes import max_bytes_per_token
from hyrax.actors.model.tokenizer import ByteTokenizer, HFTokenizer
from hyrax.api.text import fewest_tokens

CONTEXT = 2048  # gateway_fakes' model
BIG = "a" * 4_000_000


class CountingTokenizer(HFTokenizer):
    """The demo tokenizer; records the length of every text it encodes."""

    def __init__(self):
        super().__init__(DEMO_DIR / "tokenizer.json")
        self.lengths = []

    def encode(self, text):
        self.lengths.append(len(text))
        return super().encode(text)


class Finishes(Replica):
    def generate(self, request_id, prompt_ids, params):
        async def stream():
            yield {"token_ids": [104], "finished": True, "finish_reason": "length"}
        return stream()


def _chat(text: str, **kw) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **kw}


CASES = [  # (path, body of the big prompt, param)
    ("/v1/completions", {"model": "m", "prompt": BIG}, "prompt"),
    ("/v1/completions", {"model": "m", "prompt": ["hi", BIG]}, "prompt"),
    ("/v1/chat/completions", _chat(BIG), "messages"),
]


@pytest.mark.parametrize("path,body,param", CASES, ids=["string", "list", "chat"])
def test_a_prompt_the_bound_puts_over_the_context_is_refused_untokenized_with_the_exact_paths_400(path, body, param):
    tok = CountingTokenizer()
    gw = gateway(Replica(), tokenizer=tok)
    r = gw.post(path, json=body)
    assert r.status_code == 400, r.text
    early = r.json()["error"]
    assert not [n for n in tok.lengths if n >= len(BIG)], "the big prompt was tokenized"
    # the exact path's 400 for a prompt over the context that the bound lets through (2100 bytes,
    # bound 300 with the demo's 7-byte added tokens; 2100 tokens)
    small = {**body, "prompt": [x if x != BIG else "a" * 2100 for x in body["prompt"]]
             if isinstance(body.get("prompt"), list) else "a" * 2100} if "prompt" in body else _chat("a" * 2100)
    exact = gw.post(path, json=small).json()["error"]
    assert {k: early[k] for k in ("type", "code", "param")} == {k: exact[k] for k in ("type", "code", "param")} \
        == {"type": "invalid_request_error", "code": "context_length_exceeded", "param": param}, (early, exact)
    assert "at least" in early["message"] and "context is 2048 tokens" in early["message"], early


def test_max_tokens_the_bound_leaves_no_room_for_is_refused_early_as_max_tokens():
    tok = CountingTokenizer()
    r = gateway(Replica(), tokenizer=tok).post("/v1/completions", json={"model": "m", "prompt": "a" * 14000,
                                                                         "max_tokens": 100})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text
    assert r.json()["error"]["message"].startswith("prompt (at least 2000 tokens) + max_tokens (100)"), r.text
    assert tok.lengths == []


def test_a_prompt_just_under_the_bound_goes_through_the_exact_count():
    """'<|eos|>' is one token of 7 bytes, the demo's longest: 2047 of them are 2047 tokens, as the
    bound says, which leaves the context room for one: the exact count admits them."""
    tok = CountingTokenizer()
    text = "<|eos|>" * (CONTEXT - 1)
    assert fewest_tokens(tok, text) == CONTEXT - 1
    r = gateway(Finishes(), tokenizer=tok).post("/v1/completions", json={"model": "m", "prompt": text})
    assert tok.lengths == [len(text)]
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == CONTEXT - 1, r.text


def test_a_conversation_under_the_bound_is_refused_by_the_exact_count():
    """The template's own text ('<|user|>' is 8 byte tokens, not one) puts it over the context,
    which only the exact count sees: its 400 names the count, not a bound."""
    tok = CountingTokenizer()
    r = gateway(Finishes(), tokenizer=tok).post("/v1/chat/completions", json=_chat("<|eos|>" * (CONTEXT - 10)))
    assert [n for n in tok.lengths if n > 7 * (CONTEXT - 10)], "not counted exactly"
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == "messages" and "at least" not in err["message"], r.text


def test_a_byte_tokenizer_bound_is_its_exact_count():
    assert fewest_tokens(ByteTokenizer(264, EOS), "héllo ☃") == len("héllo ☃".encode())


# ---- the bound is a lower bound -----------------------------------------------------------------

def _trained(normalizer=None, pre=None, byte_fallback=False, unk=False, added=()):
    """A BPE tokenizer trained on texts full of long runs, so that it has long tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    specials = ["<unk>"] if unk else []
    tok = Tokenizer(models.BPE(unk_token="<unk>" if unk else None, byte_fallback=byte_fallback, fuse_unk=False))
    tok.normalizer, tok.pre_tokenizer = normalizer, pre
    corpus = [" " * n + "x" + "\n" * n + "-" * (2 * n) + "ab" * n + "\t" * n for n in range(1, 64)] * 4
    alphabet = [chr(c) for c in range(32, 127)] + ["\n", "\t", "é", "☃"]
    if pre is not None and "ByteLevel" in pre.__getstate__().decode():
        alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=600, special_tokens=specials,
                                                        initial_alphabet=alphabet, show_progress=False,
                                                        max_token_length=None))
    if byte_fallback:
        tok.add_tokens([f"<0x{b:02X}>" for b in range(256)])
    tok.add_special_tokens(list(added))
    return tok


def _families():
    from tokenizers import normalizers, pre_tokenizers

    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    return {
        "demo": HFTokenizer(DEMO_DIR / "tokenizer.json")._tok,
        "byte_level": _trained(pre=byte_level, added=["<|im_start|>", "<|endoftext|>"]),
        "byte_level_nfc": _trained(normalizers.NFC(), pre_tokenizers.Sequence([pre_tokenizers.Digits(), byte_level])),
        "byte_level_nfkc_lower": _trained(normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()]),
                                          byte_level),
        "metaspace_unk": _trained(normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]),
                                  unk=True),
    }


FAMILIES = {}


def _family(name):
    if not FAMILIES:
        FAMILIES.update(_families())
    return FAMILIES[name]


# runs that merge into long tokens, added tokens (the demo's <|eos|>, its longest: a run of it is
# exactly as many tokens as the bound says), and code points that normalization composes or shrinks
RUNS = st.builds(lambda c, n: c * n, st.sampled_from([" ", "\n", "\t", "-", "ab", "x", "é", "<|im_start|>", "<|eos|>",
                                                      "\u0301", "ᄀ", "ᅡ", "ᆨ", "\U0001d400", "K"]),
                 st.integers(1, 300))
TEXTS = st.lists(st.one_of(RUNS, st.text(max_size=40)), max_size=12).map("".join)


@pytest.mark.parametrize("name", ["demo", "byte_level", "byte_level_nfc", "byte_level_nfkc_lower", "metaspace_unk"])
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=TEXTS)
def test_the_bound_never_exceeds_the_token_count(name, text):
    import json

    tok = _family(name)
    most = max_bytes_per_token(json.loads(tok.to_str()))
    assert most is not None, name
    text = text.encode("utf-8", "ignore").decode("utf-8")  # no lone surrogates: no text a client sends
    count = len(tok.encode(text, add_special_tokens=False).ids)
    assert len(text.encode("utf-8")) // most <= count, (name, most, count, text[:80])


def test_tokenizers_that_can_drop_text_declare_no_bound():
    import json

    from tokenizers import normalizers, pre_tokenizers

    for tok in (_trained(normalizers.StripAccents(), pre_tokenizers.ByteLevel()),
                _trained(pre=pre_tokenizers.Whitespace(), unk=True),
                _trained(pre=pre_tokenizers.ByteLevel(), added=[])):
        spec = json.loads(tok.to_str())
        if spec["pre_tokenizer"]["type"] == "ByteLevel" and spec["normalizer"] is None:
            spec["added_tokens"].append({"id": 999, "content": "<mask>", "lstrip": True, "rstrip": False})
        assert max_bytes_per_token(spec) is None, spec["normalizer"] or spec["pre_tokenizer"]


def test_the_bound_is_worked_out_when_the_gateway_is_built_not_in_a_request():
    """For a large vocabulary the bound takes a while to work out: the model's description works it
    out at start-up, so no request handler spends that on the event loop."""
    from hyrax.api.client import ModelInfo

    tok = CountingTokenizer()
    assert "max_bytes_per_token" not in vars(tok)  # a cached property, not worked out yet
    ModelInfo(name="m", max_model_len=CONTEXT, tokenizer=tok, chat_template=None, vocab_size=300)
    assert "max_bytes_per_token" in vars(tok)
