"""Nothing is silently ignored (issue 19): unknown and unsupported fields are 400s naming the
field, bad text (lone surrogates) is a 400 everywhere, types are strict (admin API included),
stop limits apply per string and per list, malformed chat parts are clear 400s; the token
fields reach the sampler; /v1/tokenize and /v1/detokenize answer in vLLM's shape; /docs works
offline and the OpenAPI schema documents every error status with the error body's shape."""
from __future__ import annotations

import json
import re

import httpx
import pytest

from e2e_harness import ADMIN, HTTP, MODEL, assert_error
from test_error_matrix import no_generation, still_healthy  # noqa: F401 - the same fixtures (still_healthy autouse)

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BASE = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
GEN = list(BASE)


def post(url: str, path: str, body) -> httpx.Response:
    """JSON with \\u escapes (ASCII), so a lone surrogate reaches the server as JSON allows it."""
    headers = {"Content-Type": "application/json", **(ADMIN if path.startswith("/admin") else {})}
    return HTTP.post(f"{url}{path}", content=json.dumps(body), headers=headers, timeout=60)


# ---- unknown, unsupported and no-op fields --------------------------------------------------
@pytest.mark.parametrize("path", GEN + ["/v1/tokenize"])
@pytest.mark.parametrize("field", ["foo", "temprature", "include_stop_str_in_output", "Foo", "str", "list[int]"])
def test_unknown_field_is_400_naming_it(local, no_generation, path, field):
    body = {"model": MODEL, "prompt": "hi"} if path == "/v1/tokenize" else BASE[path]
    for stream in ((False, True) if path in BASE else (None,)):
        extra = {} if stream is None else {"stream": stream}
        err = assert_error(post(local.url, path, {**body, **extra, field: 1}), 400, code="unknown_parameter",
                           param=field)
        assert field in err["message"]


def test_unknown_field_of_a_chat_message_is_400(local, no_generation):
    body = {**CHAT, "messages": [{"role": "user", "content": "hi", "mood": "happy"}]}
    assert_error(post(local.url, "/v1/chat/completions", body), 400, code="unknown_parameter",
                 param="messages.0.mood")


@pytest.mark.parametrize("path,field,value", [
    ("/v1/chat/completions", "functions", [{"name": "f"}]),
    ("/v1/chat/completions", "function_call", "auto"),
    ("/v1/chat/completions", "guided_json", {"type": "object"}),
    ("/v1/completions", "guided_regex", "a+"),
    ("/v1/completions", "best_of", 2),
    ("/v1/completions", "suffix", "end"),
    ("/v1/completions", "store", True),
])
def test_unsupported_field_is_400_saying_so_and_null_means_absent(local, path, field, value):
    before = len(local.client.requests)
    err = assert_error(post(local.url, path, {**BASE[path], field: value}), 400, code="unsupported_parameter",
                       param=field)
    assert "not supported" in err["message"]
    assert len(local.client.requests) == before
    assert post(local.url, path, {**BASE[path], field: None}).status_code == 200


def test_an_answer_sent_back_as_the_openai_client_dumps_it_is_the_next_turns_assistant_message(local, oai):
    """The openai client's ChatCompletionMessage.model_dump() holds OpenAI's answer fields
    `refusal` and `annotations`, null for any answer: sending that dump back as the next turn's
    assistant message was a 400 (unknown field). Null asks for nothing; a refusal or annotations
    given are a 400 saying they are not supported."""
    first = oai.chat.completions.create(model=MODEL, messages=CHAT["messages"], max_tokens=3, temperature=0)
    dumped = first.choices[0].message.model_dump()
    assert dumped["refusal"] is None and dumped["annotations"] is None
    turns = [*CHAT["messages"], dumped, {"role": "user", "content": "more"}]
    again = oai.chat.completions.create(model=MODEL, messages=turns, max_tokens=3, temperature=0)
    without = [*CHAT["messages"], {"role": "assistant", "content": dumped["content"]}, turns[-1]]
    assert again.choices[0].message.content == oai.chat.completions.create(
        model=MODEL, messages=without, max_tokens=3, temperature=0).choices[0].message.content
    for field, value in (("refusal", "I cannot help with that."), ("annotations", [])):
        turns[1] = {**dumped, field: value}
        err = assert_error(post(local.url, "/v1/chat/completions", {**CHAT, "messages": turns}), 400,
                           code="unsupported_parameter", param=f"messages.1.{field}")
        assert "not supported" in err["message"]


def test_an_earlier_calls_arguments_nested_past_the_json_parser_are_text_to_the_template(local):
    """An earlier turn's call arguments reach the chat template as a mapping when they parse as
    JSON, else as their text. JSON nested deeper than Python's parser goes raised RecursionError
    (not a ValueError) out of that parse: a valid request was a 400 blaming the template."""
    deep = '{"a": ' * 5000 + "1" + "}" * 5000
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}
    msgs = [*CHAT["messages"], {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    r = post(local.url, "/v1/chat/completions", {**CHAT, "messages": msgs})
    assert r.status_code == 200, r.text
    assert post(local.url, "/tokenize", {"messages": msgs}).json()["count"] == r.json()["usage"]["prompt_tokens"]


@pytest.mark.parametrize("path", GEN)
def test_null_for_an_optional_field_means_its_default(local, path):
    """OpenAI's fields are nullable: null is "not set", for every optional field; a required one is still a 400."""
    nulls = {k: None for k in ("temperature", "top_p", "n", "seed", "stop", "stream", "stream_options", "logit_bias",
                               "presence_penalty", "frequency_penalty", "logprobs", "user")}
    a = post(local.url, path, {**BASE[path], "temperature": 0, **{k: v for k, v in nulls.items() if k != "temperature"}})
    b = post(local.url, path, {**BASE[path], "temperature": 0})
    assert a.status_code == b.status_code == 200, a.text
    assert a.json()["choices"] == b.json()["choices"]
    assert_error(post(local.url, path, {**BASE[path], "model": None}), 400, param="model")


@pytest.mark.parametrize("path", GEN)
@pytest.mark.parametrize("stream", [{}, {"stream": False}, {"stream": None}])
def test_stream_options_without_streaming_is_400(local, no_generation, path, stream):
    """It was silently ignored; OpenAI and vLLM refuse it too."""
    body = {**BASE[path], **stream, "stream_options": {"include_usage": True}}
    err = assert_error(post(local.url, path, body), 400, code="invalid_value", param="stream_options")
    assert "stream" in err["message"]


def test_max_tokens_and_max_completion_tokens_that_differ_are_400_naming_max_tokens(local, no_generation):
    """max_completion_tokens silently won over max_tokens."""
    err = assert_error(post(local.url, "/v1/chat/completions", {**CHAT, "max_completion_tokens": 3}), 400,
                       code="invalid_value", param="max_tokens")
    assert "max_completion_tokens" in err["message"]


@pytest.mark.parametrize("limits", [{"max_tokens": 3, "max_completion_tokens": 3}, {"max_completion_tokens": 3},
                                    {"max_tokens": 3}])
def test_chat_takes_either_token_limit_or_both_when_equal(local, limits):
    body = {**{k: v for k, v in CHAT.items() if k != "max_tokens"}, **limits, "ignore_eos": True}
    r = post(local.url, "/v1/chat/completions", body)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text


@pytest.mark.parametrize("path", GEN)
def test_documented_no_op_field_user_is_accepted(local, path):
    assert post(local.url, path, {**BASE[path], "user": "alice"}).status_code == 200
    assert_error(post(local.url, path, {**BASE[path], "user": 5}), 400, param="user")


# ---- bad text ---------------------------------------------------------------------------------
SURROGATE = "\ud800"
BAD_TEXT = [
    ("/v1/completions", {**COMPLETION, "prompt": SURROGATE}, "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": ["ok", "a" + SURROGATE]}, "prompt"),
    ("/v1/completions", {**COMPLETION, "stop": SURROGATE}, "stop"),
    ("/v1/completions", {**COMPLETION, "stop": ["ok", SURROGATE]}, "stop"),
    ("/v1/completions", {**COMPLETION, "model": SURROGATE}, "model"),
    ("/v1/completions", {**COMPLETION, "user": SURROGATE}, "user"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {SURROGATE: 1}}, "logit_bias"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" + SURROGATE}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": SURROGATE}]}]}, "messages"),
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "hi", "name": SURROGATE}]},
     "messages"),
    ("/v1/tokenize", {"prompt": SURROGATE}, "prompt"),
    ("/admin/retract", {"request_ids": [SURROGATE]}, "request_ids"),
    ("/admin/resume", {"request_ids": ["ok", SURROGATE]}, "request_ids"),
    ("/admin/migrate", {"request_id": SURROGATE}, "request_id"),
    ("/admin/drain", {"role": SURROGATE, "replica": 0}, "role"),
]


@pytest.mark.parametrize("path,body,param", BAD_TEXT, ids=[f"{p}:{q}" for p, _, q in BAD_TEXT])
def test_lone_surrogate_is_400_everywhere(local, no_generation, path, body, param):
    err = assert_error(post(local.url, path, body), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == param, err
    if path in BASE:  # a streaming request fails before any event is sent
        err = assert_error(post(local.url, path, {**body, "stream": True}), 400)


# ---- strict types -----------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/admin/forced-retraction", {"interval": False}, "interval"),
    ("/admin/forced-retraction", {"interval": True}, "interval"),
    ("/admin/forced-retraction", {"interval": 2.0}, "interval"),
    ("/admin/forced-retraction", {"interval": "3"}, "interval"),
    ("/admin/forced-retraction", {"interval": 2**70}, "interval"),
    ("/admin/forced-retraction", {"interval": -1}, "interval"),
    ("/admin/retract", {"count": True}, "count"),
    ("/admin/retract", {"all": 1}, "all"),
    ("/admin/retract", {"all": "true"}, "all"),
    ("/admin/retract", {"all": True, "hold": 1}, "hold"),
    ("/admin/drain", {"role": "decode", "replica": "0"}, "replica"),
    ("/admin/drain", {"role": "decode", "replica": 0, "undrain": "no"}, "undrain"),
    ("/v1/completions", {**COMPLETION, "stream": "true"}, "stream"),
    ("/v1/completions", {**COMPLETION, "echo": 1}, "echo"),
    ("/v1/completions", {**COMPLETION, "temperature": "0.5"}, "temperature"),
    ("/v1/completions", {**COMPLETION, "ignore_eos": "yes"}, "ignore_eos"),
    ("/v1/chat/completions", {**CHAT, "logprobs": 1}, "logprobs"),
])
def test_strict_types_booleans_are_not_integers_nor_strings(local, no_generation, path, body, param):
    err = assert_error(post(local.url, path, body), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == param, err


@pytest.mark.parametrize("path", ["/admin/retract", "/admin/resume"])
def test_empty_request_id_list_is_400(local, path):
    """Found by the fuzz: an empty list selected nothing and reached the engine as a 500."""
    assert_error(post(local.url, path, {"request_ids": []}), 400, param="request_ids")


def test_forced_retraction_takes_a_real_integer_and_zero_turns_it_off(local):
    for interval in (5, 0):
        answer = post(local.url, "/admin/forced-retraction", {"interval": interval}).json()
        assert answer["interval"] == interval and answer["replicas"], answer
        assert all(r["reached"] for r in answer["replicas"]), answer


# ---- stop limits --------------------------------------------------------------------------------
def test_stop_limits_apply_per_string_and_per_list(local):
    for stop in ("x" * 40, ["y" * 256], ["a"] * 16):
        r = post(local.url, "/v1/completions", {**COMPLETION, "stop": stop})
        assert r.status_code == 200, (stop, r.text)
    for stop in ("x" * 257, ["ok", "y" * 257], ["a"] * 17):
        err = assert_error(post(local.url, "/v1/completions", {**COMPLETION, "stop": stop}), 400)
        assert err["param"] == "stop", err


# ---- chat content parts ---------------------------------------------------------------------------
@pytest.mark.parametrize("content,says", [
    ([{"type": "text", "text": 5}], "text"),
    ([{"type": "text"}], "text"),
    ([5], "object"),
    (["hi"], "object"),
    ([{"type": "image_url", "image_url": {"url": "http://x/y.png"}}], "image_url"),
    ([{"type": "text", "text": "hi", "extra": 1}], "extra"),
    (5, "a string, a list of text parts or null, got int"),  # not "should be a valid string": a list is fine too
    ({"type": "text", "text": "hi"}, "a list of text parts"),
    (True, "got bool"),
])
def test_malformed_chat_part_is_a_clear_400(local, no_generation, content, says):
    body = {**CHAT, "messages": [{"role": "user", "content": content}]}
    err = assert_error(post(local.url, "/v1/chat/completions", body), 400)
    assert err["param"].startswith("messages.0"), err
    assert says in err["message"] and "TypeError" not in err["message"], err


def test_text_parts_are_joined_as_the_content(local):
    parts = {**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "h"},
                                                               {"type": "text", "text": "i"}]}]}
    a = post(local.url, "/v1/chat/completions", {**parts, "temperature": 0}).json()
    b = post(local.url, "/v1/chat/completions", {**CHAT, "temperature": 0}).json()
    assert a["choices"][0]["message"] == b["choices"][0]["message"]
    assert a["usage"] == b["usage"]


# ---- token-level sampling fields over HTTP ------------------------------------------------------
@pytest.mark.parametrize("path", GEN)
@pytest.mark.parametrize("patch,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"), ({"repetition_penalty": "1"}, "repetition_penalty"),
    ({"logit_bias": {"65": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"264": 1}}, "logit_bias"), ({"logit_bias": [1]}, "logit_bias"),
    ({"min_tokens": -1}, "min_tokens"), ({"min_tokens": 5}, "min_tokens"),
    ({"min_tokens": 1, "stop": "x"}, "min_tokens"), ({"min_tokens": 1, "stop": ["x"]}, "min_tokens"),
    ({"stop_token_ids": [264]}, "stop_token_ids"), ({"stop_token_ids": ["1"]}, "stop_token_ids"),
    ({"seed": 2**63}, "seed"), ({"seed": -2**63 - 1}, "seed"), ({"seed": 5 + 2**64}, "seed"),
])
def test_bad_token_sampling_field_is_400(local, no_generation, path, patch, param):
    err = assert_error(post(local.url, path, {**BASE[path], **patch}), 400)  # max_tokens 4 < min_tokens 5
    assert err["param"].split(".")[0] == param, err


@pytest.mark.parametrize("path", GEN)
@pytest.mark.parametrize("key", ["9" * 4301, "0" * 4400 + "1", "1" * 11, "01", "00"])
def test_a_logit_bias_key_that_is_not_a_canonical_short_token_id_is_400(local, no_generation, path, key):
    """int() of over 4,300 digits raised in the route (a 500); a zero-padded id would name the
    same token as its plain form, so keys are canonical decimal of at most 10 digits."""
    err = assert_error(post(local.url, path, {**BASE[path], "logit_bias": {key: 1}}), 400, code="invalid_value",
                       param="logit_bias")
    assert "without leading zeros" in err["message"] and len(err["message"]) < 300, err


@pytest.mark.parametrize("seed", [2**63 - 1, -2**63])
def test_a_seed_at_either_end_of_the_signed_64_bit_range_is_accepted(local, seed):
    """As vLLM bounds it; the sampler reduces seeds modulo 2**64, so any wider range would give
    one sampling stream two names (5 and 5 + 2**64 gave the same text)."""
    assert post(local.url, "/v1/completions", {**COMPLETION, "seed": seed, "n": 2}).status_code == 200


def test_logit_bias_key_zero_is_a_token_id(local):
    assert post(local.url, "/v1/completions", {**COMPLETION, "logit_bias": {"0": -100}}).status_code == 200


def test_logit_bias_and_stop_token_ids_reach_the_sampler(local):
    """Greedy decoding with +100 on one token picks it every time; a stop token id ends it."""
    tok = local.client.model.tokenizer
    target = tok.encode("Z")[0]
    r = post(local.url, "/v1/completions", {**COMPLETION, "temperature": 0, "max_tokens": 6,
                                            "logit_bias": {str(target): 100}}).json()
    assert r["choices"][0]["text"] == "Z" * 6, r
    r = post(local.url, "/v1/completions", {**COMPLETION, "temperature": 0, "max_tokens": 6,
                                            "logit_bias": {str(target): 100}, "stop_token_ids": [target]}).json()
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 1, r


def test_frequency_presence_and_bias_pick_what_a_direct_computation_picks(oai, local):
    """With the official client, greedy: at every step the chosen token maximises
    logprob + bias - frequency * count - presence * [count > 0] (both penalties are additive,
    so the model's logprobs, reported before processing, stand in for its logits) over the top
    20, counting the tokens generated so far."""
    from collections import Counter

    tok, vocab = local.client.model.tokenizer, local.client.model.vocab_size
    by_text: dict[str, int] = {}
    for i in range(vocab):
        by_text.setdefault(tok.decode([i]), -1 if tok.decode([i]) in by_text else i)
    freq, pres, bias = 1.5, 2.0, {"Z": 30, "N": -5}
    kw = dict(model=MODEL, prompt="t567;e03627;b86334;u8890?b", max_tokens=12, temperature=0, logprobs=20)
    plain = oai.completions.create(**kw).choices[0]
    got = oai.completions.create(**kw, frequency_penalty=freq, presence_penalty=pres,
                                 logit_bias={str(by_text[k]): v for k, v in bias.items()}).choices[0]
    assert got.text != plain.text and "Z" in got.text, (plain.text, got.text)
    counts: Counter = Counter()

    def score(s: str, lp: float) -> float:
        return lp + bias.get(s, 0) - freq * counts[s] - pres * (counts[s] > 0)

    checked = 0
    for t, lp, top in zip(got.logprobs.tokens, got.logprobs.token_logprobs, got.logprobs.top_logprobs):
        if by_text.get(t, -1) >= 0:
            best = max(score(s, v) for s, v in top.items() if by_text.get(s, -1) >= 0)
            assert score(t, lp) >= best - 1e-6, (t, score(t, lp), top)
            checked += 1
        counts[t] += 1
    assert checked >= 10


def test_min_tokens_masks_the_stop_token_until_reached(local):
    target = local.client.model.tokenizer.encode("Z")[0]
    body = {**COMPLETION, "temperature": 0, "max_tokens": 8, "logit_bias": {str(target): 100},
            "stop_token_ids": [target], "min_tokens": 3}
    r = post(local.url, "/v1/completions", body).json()
    assert r["usage"]["completion_tokens"] == 4 and r["choices"][0]["finish_reason"] == "stop", r


def test_min_p_of_1_draws_only_the_most_likely_token_and_a_smaller_one_still_samples(local):
    """Through the demo model: min_p 1 leaves each step only its most likely token, so a hot
    seeded answer equals the greedy one; min_p 0.05 at the same seed still samples."""
    body = {**COMPLETION, "prompt": "The quick brown", "max_tokens": 16, "temperature": 3.0, "seed": 5}
    text = {m: post(local.url, "/v1/completions", {**body, "min_p": m}).json()["choices"][0]["text"]
            for m in (1.0, 0.05, 0.0)}
    greedy = post(local.url, "/v1/completions", {**body, "temperature": 0}).json()["choices"][0]["text"]
    assert text[1.0] == greedy
    assert text[0.05] != greedy and text[0.0] != text[0.05]


# ---- tokenize / detokenize ------------------------------------------------------------------------
def test_tokenize_and_detokenize_in_vllms_shape_agree_with_generation(local):
    info = local.client.model
    r = post(local.url, "/v1/tokenize", {"model": MODEL, "prompt": "hello there"}).json()
    assert set(r) == {"count", "max_model_len", "tokens", "token_strs"}
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == info.max_model_len
    gen = post(local.url, "/v1/completions", {**COMPLETION, "prompt": "hello there"}).json()
    assert gen["usage"]["prompt_tokens"] == r["count"]
    assert post(local.url, "/v1/detokenize", {"model": MODEL, "tokens": r["tokens"]}).json() == {
        "prompt": "hello there"}
    chat = post(local.url, "/tokenize", {"messages": CHAT["messages"]}).json()
    gen = post(local.url, "/v1/chat/completions", CHAT).json()
    assert gen["usage"]["prompt_tokens"] == chat["count"]
    assert_error(post(local.url, "/v1/tokenize", {"model": "gpt-4", "prompt": "x"}), 404, code="model_not_found")
    assert_error(post(local.url, "/v1/tokenize", {"prompt": "x", "messages": CHAT["messages"]}), 400)
    assert_error(post(local.url, "/v1/detokenize", {"tokens": [info.vocab_size]}), 400, param="tokens")
    for field in ("add_special_tokens", "return_token_strs"):  # vLLM's, not implemented: said so
        assert_error(post(local.url, "/tokenize", {"prompt": "x", field: True}), 400, param=field,
                     code="unsupported_parameter")
        assert post(local.url, "/tokenize", {"prompt": "x", field: None}).status_code == 200


@pytest.mark.parametrize("value", [True, False])
def test_add_generation_prompt_with_a_prompt_is_400_naming_it(local, value):
    """It applies to messages only (vLLM has it on its chat form alone); with a prompt it was
    silently ignored. Null asks for nothing; with messages it still picks the template's ending."""
    err = assert_error(post(local.url, "/tokenize", {"prompt": "x", "add_generation_prompt": value}), 400,
                       code="invalid_value", param="add_generation_prompt")
    assert "messages" in err["message"]
    assert post(local.url, "/tokenize", {"prompt": "x", "add_generation_prompt": None}).json()["count"] == 1
    chat = {"messages": CHAT["messages"]}
    counts = {v: post(local.url, "/tokenize", {**chat, "add_generation_prompt": v}).json()["count"]
              for v in (True, False, None)}
    assert counts[None] == counts[True] > counts[False]


# ---- documentation ----------------------------------------------------------------------------------
def test_docs_are_served_offline_from_installed_assets(local):
    page = HTTP.get(f"{local.url}/docs")
    assert page.status_code == 200
    assert not re.findall(r"https?://", page.text), "the docs page loads something from the network"
    for src in re.findall(r'(?:src|href)="([^"]+)"', page.text):
        assert HTTP.get(f"{local.url}{src}").status_code == 200, src
    assert HTTP.get(f"{local.url}/openapi.json").status_code == 200


def test_without_the_assets_package_docs_are_off_and_the_schema_stays(local, gateway_with, monkeypatch):
    from hyrax.api import docs_routes

    monkeypatch.setattr(docs_routes, "_swagger_assets", lambda: None)
    url = gateway_with()
    assert_error(HTTP.get(f"{url}/docs"), 404)
    assert_error(HTTP.get(f"{url}/redoc"), 404)
    assert "/v1/completions" in HTTP.get(f"{url}/openapi.json").json()["paths"]


def test_openapi_documents_every_error_status_with_the_error_shape(local):
    schema = HTTP.get(f"{local.url}/openapi.json").json()
    err = schema["components"]["schemas"]["ErrorResponse"]
    assert err["required"] == ["error"]
    ops = schema["paths"]
    for path, methods in ops.items():
        for method, op in methods.items():
            assert "422" not in op["responses"], (method, path)
            for status, r in op["responses"].items():
                if status != "200":
                    assert r["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(ops["/v1/completions"]["post"]["responses"]) == {"200", "400", "401", "404", "413", "415", "503"}
    assert set(ops["/admin/migrate"]["post"]["responses"]) == {"200", "400", "401", "404", "409", "413", "415"}
    assert {"400", "401", "404"} <= set(ops["/v1/tokenize"]["post"]["responses"])
    assert set(ops["/v1/models/{model}"]["get"]["responses"]) == {"200", "401", "404"}
    assert "404" in ops["/admin/retract"]["post"]["responses"] and "404" in ops["/admin/resume"]["post"]["responses"]
    assert "503" in ops["/health"]["get"]["responses"]
    assert "CompletionResponse" in schema["components"]["schemas"]


@pytest.mark.parametrize("n", [0, 1])
def test_completions_top_logprobs_hold_the_sampled_token_and_chat_exactly_the_top(oai, n):
    """With the official client, hot seeded sampling through the demo model: every completions
    position's top_logprobs holds its sampled token with its logprob (OpenAI: up to logprobs + 1
    entries), some positions one past the top n; chat's top_logprobs are exactly top_logprobs."""
    kw = dict(model=MODEL, max_tokens=24, temperature=5.0, seed=11)
    lp = oai.completions.create(**kw, prompt="The quick brown", logprobs=n).choices[0].logprobs
    for t, v, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[t] >= v - 1e-9 and len(top) <= n + 1, (t, v, top)  # a key tokens share: the most likely
    assert any(len(top) == n + 1 for top in lp.top_logprobs)
    content = oai.chat.completions.create(**kw, messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                          top_logprobs=n).choices[0].logprobs.content
    assert content and all(len(e.top_logprobs) == n for e in content)
