"""What a client is told when its request's step raised on live ranks (`StepError`: a kernel that
refused its input, an error inside the forward). The replica ends that step's requests with
finish_reason "error" and keeps its ranks (recovery.py); the client must hear that something
failed: a non-streaming call that failed before any token gets an error answer, a stream gets
the error event after its "error" chunk (docs/api.md, Errors). Without an error in the replica's
last item the gateway answered a 200 with an empty text, and a stream ended as if nothing was
wrong beyond the finish reason."""
from __future__ import annotations

import dataclasses
import json

import pytest

from engine_helpers import BASE_CONFIG, HYBRID, tiny_model
from gateway_fakes import gateway
from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from hyrax.actors.engine.local import engine_for_model
from hyrax.actors.engine.loop import EngineLoop
from hyrax.api.client import LocalBackend

PROMPT = "0123456789" * 4  # 40 byte tokens (ids below the tiny vocabulary): the fault fires at the first step that reaches 36 tokens


def _replica():
    faults = UnsafeFaults(step_error_at_context=36)
    config = dataclasses.replace(EngineConfig(**BASE_CONFIG), faults=faults, allow_unsafe=True)
    return EngineLoop(engine_for_model(tiny_model(HYBRID), config), "step-error-answer")


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_whose_first_step_raised_on_live_ranks_is_an_error_answer_not_an_empty_200(stream):
    loop = _replica()
    try:
        client = gateway(LocalBackend(loop))
        r = client.post("/v1/completions", json={"model": "m", "prompt": PROMPT, "max_tokens": 5, "stream": stream})
        assert r.status_code >= 500, (r.status_code, r.text)
        err = r.json()["error"]
        assert err["code"] in ("internal_error", "unavailable") and "Error" not in err["message"], err
        assert loop.engine.stats.step_errors == 1 and not loop.engine.requests
    finally:
        loop.shutdown()


def test_a_stream_whose_step_raised_on_live_ranks_after_a_token_ends_with_an_error_event():
    loop = _replica()
    try:
        client = gateway(LocalBackend(loop))
        with client.stream("POST", "/v1/completions",  # 34 tokens: the fault fires at its third token
                           json={"model": "m", "prompt": PROMPT[:34], "max_tokens": 5, "stream": True}) as r:
            events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", events
        bodies = [json.loads(e) for e in events[:-1]]
        assert any(b.get("choices") and b["choices"][0]["text"] for b in bodies), bodies  # tokens came first
        assert any(b.get("choices") and b["choices"][0]["finish_reason"] == "error" for b in bodies), bodies
        assert "error" in bodies[-1], bodies  # the error event follows the "error" chunk
    finally:
        loop.shutdown()
