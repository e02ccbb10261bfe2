"""`hyrax generate` refuses a prompt plus --max-tokens beyond the model's context as the HTTP API
refuses the same request (a 400 `context_length_exceeded`), by the same rule: it ran to finish
"length" instead. Without --max-tokens the default is capped to what the context leaves, as the
API's default is. The demo model's context is 2048 tokens."""
from __future__ import annotations

import json

from gateway_fakes import gateway
from hyrax.cluster import cli

CONTEXT = 2048


def _ids(n: int) -> str:
    return ",".join(["7"] * n)


def test_generate_refuses_max_tokens_beyond_the_context_as_the_api_does(capsys):
    assert cli.main(["generate", "--prompt-ids", _ids(CONTEXT - 8), "--max-tokens", "20"]) == 2
    err = capsys.readouterr().err.splitlines()
    api = gateway().post("/v1/completions", json={"model": "m", "prompt": [7] * (CONTEXT - 8), "max_tokens": 20})
    assert api.status_code == 400 and api.json()["error"]["code"] == "context_length_exceeded", api.text
    assert err == ["hyrax: error: " + api.json()["error"]["message"].replace("max_tokens", "--max-tokens")], err
    assert "context of 2048 tokens" in err[0]


def test_generate_names_which_prompt_is_over_the_context(capsys):
    assert cli.main(["generate", "--prompt-ids", "1,2,3", "--prompt-ids", _ids(CONTEXT), "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"hyrax: error: prompt 2: prompt has {CONTEXT} tokens; the model's context is {CONTEXT} tokens"], err


def test_generate_without_max_tokens_takes_what_the_context_leaves(capsys):
    assert cli.main(["generate", "--prompt-ids", _ids(CONTEXT - 3), "--ignore-eos", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)["outputs"]
    assert [(len(o["token_ids"]), o["finish_reason"]) for o in out] == [(3, "length")], out
