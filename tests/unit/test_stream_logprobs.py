"""A streamed answer reports the same logprobs as the whole answer: every token's entry once, in
order, with the same values (the completions route's `text_offset` counts from the start of the
completion in both). The gateway runs over a scripted replica, so no engine is needed."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from hyrax.actors.model.tokenizer import ByteTokenizer
from hyrax.api.app import GatewaySettings, create_app
from hyrax.api.client import EngineClient, ModelInfo

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


@pytest.fixture
def gateway():
    def make(tokens: list[int], reason: str = "stop") -> TestClient:
        client = EngineClient(ModelInfo("m", 2048, ByteTokenizer(264, EOS), None, 264, (EOS,)),
                              [ScriptedReplica(_items(tokens, reason))])
        app = create_app(client, GatewaySettings(admin_token="t"))
        app.state.ready = True
        return TestClient(app)
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
    http = gateway(tokens)
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["logprobs"]
    joined = {k: [] for k in whole}
    for ev in _events(http.post("/v1/completions", json={**body, "stream": True}).text):
        for c in ev["choices"]:
            for k in joined:
                joined[k] += (c["logprobs"] or {}).get(k, [])
    assert whole["text_offset"] == [0, 1, 2, 3, 4, 5][:len(tokens)]
    assert joined == whole
