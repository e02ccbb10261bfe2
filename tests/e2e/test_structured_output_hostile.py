"""Structured output and tool calls as an unlucky or hostile client sends them, over HTTP to the
in-process engine: a schema that only rank 0's compile refused failed the step of every request
batched with it (503s for other clients); choices outside the Basic Multilingual Plane came back
as replacement characters."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx

from e2e_harness import MODEL, assert_error


def _chat(url: str, **extra) -> httpx.Response:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 24, "temperature": 1.0,
            "seed": 1, **extra}
    return httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)


def test_a_schema_only_the_compile_refuses_is_a_400_and_other_requests_are_unharmed(local):
    bad = {"structured_outputs": {"json": {"type": "string", "minLength": -1}}}
    with ThreadPoolExecutor(4) as pool:
        innocent = [pool.submit(_chat, local.url, ignore_eos=True) for _ in range(3)]
        refused = pool.submit(_chat, local.url, **bad)
        assert [f.result().status_code for f in innocent] == [200] * 3
        err = assert_error(refused.result(), 400, "invalid_value", "structured_outputs")
    assert "minLength" in err["message"], err
    err = assert_error(_chat(local.url, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "string", "minLength": -1}}}), 400, "invalid_value", "response_format")


def test_choices_outside_the_bmp_come_back_as_one_of_them(local):
    options = ["😀", "😂 ok"]
    for seed in range(3):
        r = _chat(local.url, seed=seed, structured_outputs={"choice": options})
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] in options and choice["finish_reason"] == "stop", choice
