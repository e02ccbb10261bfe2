"""A call asking for more choices (prompts x n) than the server admits at once is refused before
any of its prompts is tokenized or turned into a choice: a 4 MB body of 800,000 one-token prompts
with n=16 kept the gateway's event loop busy for minutes (every other client stalled) only to be
told "too many choices". The gateway runs over a scripted replica, so no engine is needed."""
from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from hyrax.actors.model.tokenizer import ByteTokenizer
from hyrax.api import openai_routes
from hyrax.api.app import GatewaySettings, create_app
from hyrax.api.client import EngineClient, ModelInfo

EOS = 256


class CountingTokenizer(ByteTokenizer):
    def __init__(self):
        super().__init__(264, EOS)
        self.encoded = 0

    def encode(self, text: str) -> list[int]:
        self.encoded += 1
        return super().encode(text)


class IdleReplica:
    role, index = "colocated", 0

    def generate(self, request_id, prompt_ids, params):
        raise AssertionError("a refused call reached the replica")

    async def health(self) -> dict:
        return {"role": self.role, "replica": self.index, "healthy": True, "stuck": None}


def serve(tok, **limits) -> tuple[TestClient, EngineClient]:
    client = EngineClient(ModelInfo("m", 2048, tok, None, 264, (EOS,)), [IdleReplica()], **limits)
    app = create_app(client, GatewaySettings(admin_token="t"))
    app.state.ready = True
    return TestClient(app), client


@pytest.fixture
def gateway():
    tok = CountingTokenizer()
    return serve(tok, max_choices=8)[0], tok


@pytest.mark.parametrize("prompt", [["ab"] * 5, [[97, 98]] * 5], ids=["texts", "token_ids"])
def test_a_call_over_the_choice_limit_is_refused_before_its_prompts_are_read(gateway, monkeypatch, prompt):
    http, tok = gateway
    built = []
    monkeypatch.setattr(openai_routes, "Choice", lambda *a, **kw: built.append(a))
    r = http.post("/v1/completions", json={"model": "m", "prompt": prompt, "n": 2, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "too_many_choices" and "10 choices" in err["message"] and "8" in err["message"]
    assert tok.encoded == 0 and built == []


def test_a_call_of_more_choices_than_the_server_ever_holds_in_flight_is_400_not_a_retry_later():
    """With --max-inflight below the per-call cap, such a call was a 503 with Retry-After on an
    idle server: a client that follows Retry-After retries it forever."""
    http, client = serve(ByteTokenizer(264, EOS), max_inflight=4)
    r = http.post("/v1/completions", json={"model": "m", "prompt": "ab", "n": 5, "max_tokens": 1})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "too_many_choices" and "5 choices" in err["message"] and "4" in err["message"]
    assert client.admitted == 0
