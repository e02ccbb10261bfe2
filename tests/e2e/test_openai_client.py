"""The gateway through the official `openai` Python client: completions, chat, streaming
with usage, stop strings, n, seeds, token-id prompts. The demo model is random, so outputs
are compared between runs, never with expected words."""
from __future__ import annotations

import pytest

from e2e_harness import MODEL

PROMPT = "The quick brown fox jumps over the lazy dog."
# The demo model is trained (docs/demo-model.md) and sure of itself on any prompt: sampling
# tests use a temperature that flattens its distribution enough for draws to differ
HOT = 20.0


def greedy(oai, prompt=PROMPT, max_tokens=32, **kw):
    return oai.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                  extra_body={"ignore_eos": True}, **kw)


def test_models_list_names_the_served_model(oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].object == "model"


def test_completion_returns_text_usage_and_length_finish(oai):
    r = greedy(oai, max_tokens=24)
    assert r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason == "length"
    assert r.choices[0].text
    assert r.usage.prompt_tokens == len(PROMPT.encode())  # the demo tokenizer is byte-level
    assert r.usage.completion_tokens == 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24
    assert greedy(oai, max_tokens=24).choices[0].text == r.choices[0].text  # greedy is reproducible


def test_chat_completion_returns_an_assistant_message(oai):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert r.object == "chat.completion" and r.model == MODEL
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content
    assert c.finish_reason == "length"
    assert r.usage.completion_tokens == 16 and r.usage.prompt_tokens > len("Be brief.Hello!")
    again = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=16, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert again.choices[0].message.content == c.message.content


def test_streamed_completion_equals_the_unstreamed_one_and_ends_with_usage(oai):
    full = greedy(oai, max_tokens=24)
    chunks = list(greedy(oai, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    *text_chunks, last = chunks
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 24 and last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in text_chunks)
    assert len(text_chunks) > 1  # streamed, not sent at once
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in text_chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_stream_without_include_usage_sends_no_usage_chunk(oai):
    chunks = list(greedy(oai, max_tokens=8, stream=True))
    assert chunks and all(c.choices and c.usage is None for c in chunks)


def test_streamed_chat_equals_the_unstreamed_one_and_ends_with_usage(oai):
    msgs = [{"role": "user", "content": "Stream, please."}]
    kw = dict(model=MODEL, messages=msgs, max_tokens=20, temperature=0, extra_body={"ignore_eos": True})
    full = oai.chat.completions.create(**kw)
    chunks = list(oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
    *deltas, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 20
    assert deltas[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in deltas) == full.choices[0].message.content
    assert deltas[-1].choices[0].finish_reason == "length"
    assert all(c.object == "chat.completion.chunk" for c in chunks)


def _stop_string(text: str) -> tuple[str, int]:
    """Two printable ASCII characters of `text`, first seen at index >= 2."""
    for i in range(2, len(text) - 1):
        s = text[i:i + 2]
        if all(33 <= ord(ch) < 127 for ch in s) and text.find(s) == i:
            return s, i
    pytest.fail(f"no usable stop string in {text!r}")


@pytest.mark.parametrize("prompt", [PROMPT, "Hello, Hyrax!"])
def test_stop_string_cuts_the_text_before_it_and_finishes_with_stop(oai, prompt):
    text = greedy(oai, prompt, max_tokens=32).choices[0].text
    stop, at = _stop_string(text)

    r = greedy(oai, prompt, max_tokens=32, stop=stop)
    assert r.choices[0].text == text[:at]
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens < 32  # the engine stopped, not just the text

    streamed = list(greedy(oai, prompt, max_tokens=32, stop=[stop, "\x00never\x00"], stream=True))
    assert "".join(c.choices[0].text for c in streamed) == text[:at]
    assert streamed[-1].choices[0].finish_reason == "stop"

    missing = greedy(oai, prompt, max_tokens=32, stop=["\x00never\x00"])
    assert missing.choices[0].text == text and missing.choices[0].finish_reason == "length"


def test_n2_returns_two_choices_indexed_0_and_1(oai):
    r = greedy(oai, max_tokens=12, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert r.choices[0].text == r.choices[1].text  # greedy: both choices agree
    assert r.usage.completion_tokens == 24

    s = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=HOT, seed=11, n=2,
                               extra_body={"ignore_eos": True})
    assert sorted(c.index for c in s.choices) == [0, 1]
    assert s.choices[0].text != s.choices[1].text  # sampled choices are independent draws


def test_n2_usage_counts_the_prompt_once(oai):
    r = greedy(oai, prompt=[1, 2, 3], max_tokens=4, n=2)
    assert r.usage.prompt_tokens == 3


def test_same_seed_reproduces_sampled_text_and_other_seeds_differ(oai):
    def sample(seed):
        return oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=HOT, seed=seed,
                                      extra_body={"ignore_eos": True}).choices[0].text

    a = sample(1234)
    assert sample(1234) == a
    others = {sample(s) for s in (1, 2, 3)}
    assert a not in others and len(others) == 3  # 24 near-uniform draws from 264 tokens: no collision
    assert a != greedy(oai, max_tokens=24).choices[0].text


def test_token_id_prompts_equal_their_text_prompt(oai):
    ids = list("abc".encode())
    assert greedy(oai, prompt=ids, max_tokens=12).choices[0].text == greedy(oai, "abc", 12).choices[0].text

    r = greedy(oai, prompt=[1, 2, 3], max_tokens=8)
    assert r.usage.prompt_tokens == 3 and r.usage.completion_tokens == 8

    batch = greedy(oai, prompt=[[1, 2, 3], ids], max_tokens=8)
    assert sorted(c.index for c in batch.choices) == [0, 1]
    by_index = {c.index: c.text for c in batch.choices}
    assert by_index[0] == r.choices[0].text
    assert by_index[1] == greedy(oai, "abc", 8).choices[0].text


def test_logprobs_come_back_per_token_in_completions_and_chat(oai):
    r = oai.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=4, temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(lp.tokens) == r.usage.completion_tokens == 4
    assert all(v <= 0 for v in lp.token_logprobs) and all(len(t) >= 1 for t in lp.top_logprobs)
    c = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=3,
                                    temperature=0, logprobs=True, top_logprobs=2)
    content = c.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)
    # greedy: the chosen token is the most likely one
    assert all(t.logprob == max(a.logprob for a in t.top_logprobs) for t in content)
