"""An answer's text is decoded after the prompt's last tokens (`TextStream.after_prompt`), as
the text it continues. A SentencePiece-style decoder drops a text's first token's leading space,
so an answer '▁Hello ▁world' decoded on its own read 'Hello world' where vLLM answers ' Hello
world', its logprob tokens read ' Hello' at offset 0 of a text without the space, and a stop
string ' Hello' never matched. The gateway's text and the engine's stop strings read the same
text; byte-level tokenizers (every shipped checkpoint) decode the same as before."""
from __future__ import annotations

import random

from hyrax.actors.engine.request import Request, SamplingParams
from hyrax.actors.engine.results import StopRule
from hyrax.actors.model.text_stream import TextStream
from hyrax.actors.model.tokenizer import load_tokenizer
from test_stream_logprobs import _sentencepiece_style

DEMO = "hyrax/models/demo"


def _stream(decode, prompt, answer, stop=(), one_by_one=True) -> tuple[str, bool]:
    s = TextStream.after_prompt(decode, prompt, stop)
    if one_by_one:
        for t in answer:
            s.feed([t])
    else:
        s.feed(list(answer))
    s.finish()
    return s.emitted, s.stopped


def test_a_sentencepiece_answer_keeps_its_first_tokens_space(tmp_path):
    for decoder in ("llama", "metaspace"):
        tok, vocab = _sentencepiece_style(tmp_path, decoder)
        prompt = tok.encode("hi")
        answer = [vocab["▁Hello"], vocab["▁world"], vocab["!"]]
        assert TextStream(tok.decode).feed(answer) == "Hello world!"  # on its own: the space is gone
        for one_by_one in (True, False):
            assert _stream(tok.decode, prompt, answer, one_by_one=one_by_one) == (" Hello world!", False), decoder
        assert _stream(tok.decode, prompt, answer, stop=(" Hello",)) == ("", True)
        assert _stream(tok.decode, prompt, answer, stop=("d!",)) == (" Hello worl", True)


def test_the_engine_stops_on_the_same_text_the_gateway_streams(tmp_path):
    tok, vocab = _sentencepiece_style(tmp_path, "metaspace")
    rule = StopRule(eos={1}, max_model_len=100, decode=tok.decode)
    req = Request("r", tok.encode("hi"), SamplingParams(max_tokens=10, stop=(" Hello",)), seed=0)
    req.output_ids.append(vocab["▁Hello"])
    assert rule.reason(req, vocab["▁Hello"]) == "stop" and req.text == ""


def test_byte_level_answers_decode_as_they_did_on_their_own():
    tok = load_tokenizer(DEMO, 259)
    rng = random.Random(5)
    byte_ids = [i for i in range(259) if tok.token_bytes(i)]
    for _ in range(300):
        prompt = [rng.choice(byte_ids) for _ in range(rng.randrange(0, 8))]
        answer = [rng.choice(byte_ids) for _ in range(rng.randrange(1, 12))]
        alone = TextStream(tok.decode)
        for t in answer:
            alone.feed([t])
        alone.finish()
        assert _stream(tok.decode, prompt, answer)[0] == alone.emitted, (prompt, answer)
