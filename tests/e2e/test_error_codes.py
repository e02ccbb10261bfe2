"""Every client error names a documented `code` (docs/api.md's error table): the checks the
routes make after pydantic (token ids against the vocabulary, prompt length, structured output,
tools, X-Request-Id) as much as pydantic's own. A body the server cannot read as JSON (empty,
a number too long for the parser, nesting too deep, not UTF-8, duplicate keys) is
`invalid_json`, and JSON in another charset is a 415. OpenAI's retrieve-model route answers,
and 401s say how to authenticate (`WWW-Authenticate: Bearer`)."""
from __future__ import annotations

import gzip
import json
import zlib

import pytest

from e2e_harness import ADMIN, HTTP, MODEL, assert_error
from test_error_matrix import no_generation, still_healthy  # noqa: F401 - the same fixtures (still_healthy autouse)

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SURROGATE = "\ud800"


def post(url: str, path: str, body, headers=None):
    """JSON with \\u escapes (ASCII), so a lone surrogate reaches the server as JSON allows it."""
    return HTTP.post(f"{url}{path}", content=json.dumps(body), timeout=60,
                     headers={"Content-Type": "application/json", **(headers or {})})


CASES = [  # (path, body, headers, code, param)
    ("/v1/completions", {**COMPLETION, "stop_token_ids": [264]}, None, "invalid_value", "stop_token_ids"),
    ("/v1/completions", {**COMPLETION, "logit_bias": {"264": 1}}, None, "invalid_value", "logit_bias"),
    ("/v1/completions", {**COMPLETION, "prompt": [[]]}, None, "invalid_value", "prompt"),
    ("/v1/completions", {**COMPLETION, "prompt": [1, 264]}, None, "invalid_value", "prompt"),
    ("/v1/completions", {**COMPLETION, "min_tokens": 1000000}, None, "invalid_value", "min_tokens"),
    ("/v1/completions", {**COMPLETION, "echo": True, "logprobs": 1}, None, "unsupported_parameter", "echo"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_object"}, "ignore_eos": True}, None,
     "invalid_value", "ignore_eos"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_object"},
                         "structured_outputs": {"regex": "a"}}, None, "invalid_value", "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"choice": [""]}}, None, "invalid_value",
     "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": "{nope"}}, None, "invalid_value",
     "structured_outputs"),
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "nonsense"}}}}, None, "invalid_value", "response_format"),
    ("/v1/completions", COMPLETION, {"X-Request-Id": "no spaces"}, "invalid_value", "X-Request-Id"),
    ("/v1/chat/completions", {**CHAT, "top_logprobs": 2}, None, "invalid_value", "top_logprobs"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL, TOOL], "tool_choice": "required"}, None, "invalid_value",
     "tools"),
    ("/v1/chat/completions", {**CHAT, "tools": [TOOL], "tool_choice": {"type": "function", "function": {
        "name": "g"}}}, None, "invalid_value", "tool_choice"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}, None, "invalid_value", "tool_choice"),
    ("/v1/tokenize", {"prompt": "hi", "model": "nope"}, None, "model_not_found", "model"),
    ("/v1/detokenize", {"tokens": [264]}, None, "invalid_value", "tokens"),
]


@pytest.mark.parametrize("path,body,headers,code,param", CASES, ids=[f"{c[0]}:{c[4]}:{i}" for i, c in enumerate(CASES)])
def test_every_client_error_names_its_documented_code(local, no_generation, path, body, headers, code, param):
    for stream in ((False, True) if path.endswith("completions") else (None,)):
        sent = body if stream is None else {**body, "stream": stream}
        assert_error(post(local.url, path, sent, headers), 400 if code != "model_not_found" else 404, code=code,
                     param=param)


def test_prompt_over_the_context_names_messages_in_chat_and_prompt_in_completions(local, no_generation):
    ctx = local.client.model.max_model_len
    assert_error(post(local.url, "/v1/completions", {**COMPLETION, "prompt": [65] * ctx}), 400,
                 code="context_length_exceeded", param="prompt")
    too_long = {**CHAT, "messages": [{"role": "user", "content": "A" * ctx}]}
    assert_error(post(local.url, "/v1/chat/completions", too_long), 400, code="context_length_exceeded",
                 param="messages")


# ---- bodies that are not JSON the server can read --------------------------------------------------
def raw(url: str, path: str, content: bytes, ctype: str = "application/json"):
    return HTTP.post(f"{url}{path}", content=content, headers={"Content-Type": ctype}, timeout=60)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/v1/tokenize", "/admin/retract"])
def test_an_empty_body_is_invalid_json_not_a_missing_field(local, no_generation, path):
    for ctype in ("application/json", None):
        headers = {**ADMIN, **({"Content-Type": ctype} if ctype else {})}
        err = assert_error(HTTP.post(f"{local.url}{path}", content=b"", headers=headers), 400, code="invalid_json")
        assert "empty" in err["message"], err
    # a route whose body is optional still takes none
    assert HTTP.post(f"{local.url}/admin/flush-cache", content=b"", headers=ADMIN).status_code == 200


@pytest.mark.parametrize("content,says", [
    (b'{"model": "hyrax-demo", "prompt": "hi", "max_tokens": ' + b"1" * 5000 + b"}", "digits"),
    (b'{"model": "hyrax-demo", "prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested"),
    (b'{"model": "hyrax-demo", "prompt": "hi", "prompt": "again"}', "'prompt'"),
    (b'{"model": "hyrax-demo", "prompt": "hi", "logit_bias": {"1": 1, "1": 2}}', "'1'"),
    (b'{"model": "hyrax-demo", "prompt": "hi", "temperature": NaN}', "NaN is not a JSON value"),
    (b'{"model": "hyrax-demo", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
     b'{"name": "x", "schema": {"type": "number", "maximum": -Infinity}}}}', "-Infinity is not a JSON value"),
    (json.dumps(COMPLETION).encode("utf-16"), "UTF-8"),
    (json.dumps(COMPLETION).encode("utf-16-le"), "UTF-8"),
    (json.dumps(COMPLETION).encode("utf-32"), "UTF-8"),
], ids=["long-int", "deep", "dup-key", "dup-nested-key", "nan", "infinity", "utf-16", "utf-16-le-no-bom", "utf-32"])
def test_json_the_server_cannot_read_is_invalid_json_saying_why(local, no_generation, content, says):
    err = assert_error(raw(local.url, "/v1/completions", content), 400, code="invalid_json")
    assert says in err["message"], err
    assert "error parsing the body" not in err["message"]


def test_json_in_another_charset_than_utf8_is_415(local):
    body = json.dumps(COMPLETION).encode()
    for ctype in ("application/json; charset=latin-1", "application/json; charset=utf-16",
                  'application/json;charset="iso-8859-1"'):
        err = assert_error(raw(local.url, "/v1/completions", body, ctype), 415, code="unsupported_media_type")
        assert "UTF-8" in err["message"], err
    for ctype in ("application/json; charset=utf-8", "application/json; charset=UTF-8",
                  "application/json;charset=utf8"):
        assert raw(local.url, "/v1/completions", body, ctype).status_code == 200


@pytest.mark.parametrize("coding,compress", [("gzip", gzip.compress), ("deflate", zlib.compress),
                                             ("br", lambda b: b), ("gzip, identity", gzip.compress)])
def test_a_compressed_body_is_415_naming_its_content_encoding(local, coding, compress):
    """The gateway reads bodies as they come: a Content-Encoding was ignored and the compressed
    bytes read as JSON, a 400 guessing at UTF-16 ("it has NUL bytes") or at bad UTF-8. RFC 9110
    answers a content coding the server does not take with a 415; identity is no coding."""
    body = json.dumps(COMPLETION).encode()
    for path in ("/v1/completions", "/v1/chat/completions", "/v1/tokenize"):
        r = HTTP.post(f"{local.url}{path}", content=compress(body), timeout=60,
                      headers={"Content-Type": "application/json", "Content-Encoding": coding})
        err = assert_error(r, 415, code="unsupported_media_type", param="Content-Encoding")
        assert coding in err["message"] and "uncompressed" in err["message"], err
    r = HTTP.post(f"{local.url}/v1/completions", content=body, timeout=60,
                  headers={"Content-Type": "application/json", "Content-Encoding": "identity"})
    assert r.status_code == 200, r.text


def test_a_lone_surrogate_in_an_unknown_key_is_an_unknown_field_named_escaped(local, no_generation):
    for body, param in (({**COMPLETION, SURROGATE: 1}, "\\ud800"),
                        ({**CHAT, "messages": [{"role": "user", "content": "hi", "a" + SURROGATE: 1}]},
                         "messages.0.a\\ud800")):
        path = "/v1/completions" if "prompt" in body else "/v1/chat/completions"
        err = assert_error(post(local.url, path, body), 400, code="unknown_parameter", param=param)
        assert param in err["message"], err


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {**COMPLETION, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["a", SURROGATE]}}}}, "response_format.json_schema.schema"),
    ("/v1/completions", {**COMPLETION, "structured_outputs": {"json": {"properties": {SURROGATE: {}}}}},
     "structured_outputs.json"),
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required", "tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object", "description": "x" + SURROGATE}}}]},
     "tools.0.function.parameters"),
])
def test_a_lone_surrogate_in_a_schema_is_the_usual_bad_text_400(local, no_generation, path, body, param):
    err = assert_error(post(local.url, path, body), 400, code="invalid_value", param=param)
    assert "lone surrogate" in err["message"] and "Check failed" not in err["message"], err


@pytest.mark.parametrize("schema,says", [
    ('{"type": "number", "minimum": 1e400}', "a number at minimum is out of range"),
    ('{"type": "object", "properties": {"a": {"enum": [1, -1e999]}}}', "a number at properties.a.enum.1 is out"),
    ('{"type": "number", "maximum": 1' + "0" * 400 + '}', "a number at maximum is out of range"),
    ('{"type": "integer", "minimum": 100000000000000000000}', "100000000000000000000 at minimum is out of range"),
    ('{"type": ["integer", "null"], "exclusiveMaximum": -1e19}', "-1e+19 at exclusiveMaximum is out of range"),
])
def test_a_number_in_a_schema_beyond_what_the_grammar_engine_reads_is_out_of_range(local, no_generation, schema,
                                                                                    says):
    """1e400 reached xgrammar as Infinity: 'Check failed: (error.empty()) is false: Failed to parse JSON'."""
    body = ('{"model": "%s", "prompt": "hi", "response_format": {"type": "json_schema", "json_schema": '
            '{"name": "x", "schema": %s}}}' % (MODEL, schema))
    err = assert_error(raw(local.url, "/v1/completions", body.encode()), 400, code="invalid_value",
                       param="response_format")
    assert says in err["message"] and "Check failed" not in err["message"], err


def test_integer_bounds_at_the_ends_of_int64_are_taken(local):
    ok = {**COMPLETION, "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "integer", "minimum": -2**63, "maximum": 2**63 - 1}}}}
    assert post(local.url, "/v1/completions", ok).status_code == 200


def test_json_with_an_emoji_in_a_schema_is_fine(local):
    """A surrogate pair (\\ud83d\\ude00, one character) is valid text."""
    body = {**COMPLETION, "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"enum": ["\U0001F600"]}}}}
    assert post(local.url, "/v1/completions", body).status_code == 200


# ---- /v1/models/{model} and 401s -------------------------------------------------------------------
def test_retrieve_model_answers_in_openais_shape(local, oai):
    r = HTTP.get(f"{local.url}/v1/models/{MODEL}")
    assert r.status_code == 200, r.text
    card = r.json()
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "hyrax"
    assert card == HTTP.get(f"{local.url}/v1/models").json()["data"][0]
    assert oai.models.retrieve(MODEL).id == MODEL
    for name in ("gpt-4", "org/other-model"):
        err = assert_error(HTTP.get(f"{local.url}/v1/models/{name}"), 404, code="model_not_found", param="model")
        assert name in err["message"]


def test_401_says_how_to_authenticate(local, gateway_with):
    url = gateway_with(api_keys=("k1",))
    for r in (HTTP.get(f"{url}/v1/models"), HTTP.post(f"{url}/v1/completions", json=COMPLETION),
              HTTP.get(f"{url}/v1/models/{MODEL}"), HTTP.get(f"{url}/admin/requests"),
              HTTP.get(f"{url}/admin/requests", headers={"Authorization": "Bearer k1"})):
        assert_error(r, 401)
        assert r.headers.get("www-authenticate") == "Bearer", r.headers


# ---- query strings ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path,query,name", [
    ("POST", "/v1/completions", "stream=true", "stream"),
    ("POST", "/v1/chat/completions", "max_tokens=1", "max_tokens"),
    ("POST", "/v1/tokenize", "model=x&", "model"),
    ("GET", "/v1/models", "limit=1", "limit"),
    ("GET", f"/v1/models/{MODEL}", "x", "x"),
    ("GET", "/admin/events", "limit=abc", "limit"),
    ("POST", "/admin/flush-cache", "all=1", "all"),
    ("GET", "/health", "verbose=1", "verbose"),
    ("GET", "/metrics", "name[]=x", "name[]"),
    ("GET", "/version", "v=2", "v"),
    ("GET", "/dashboard/summary", "t=1", "t"),
    ("GET", "/openapi.json", "format=yaml", "format"),
])
def test_a_query_parameter_no_route_declares_is_400_naming_it(local, method, path, query, name):
    """No route takes query parameters: one given was ignored (`?stream=true` streamed nothing)."""
    body = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT, "/v1/tokenize": {"prompt": "hi"}}.get(path)
    r = HTTP.request(method, f"{local.url}{path}?{query}", json=body, headers=ADMIN, timeout=60)
    err = assert_error(r, 400, code="unknown_parameter", param=name)
    assert f"query parameter {name!r}" in err["message"], err
    # the same call without the query is served, and an empty query is none
    assert HTTP.request(method, f"{local.url}{path}?", json=body, headers=ADMIN, timeout=60).status_code in (200, 404)


# ---- unknown paths ---------------------------------------------------------------------------------
@pytest.mark.parametrize("method,path", [
    ("POST", "/v1/completions/"), ("POST", "/v1/chat/completions/"), ("GET", "/v1/models/?"),
    ("GET", "/health/"), ("GET", "/dashboard/"), ("POST", "/admin/retract/"), ("GET", "/v2/models"),
])
def test_an_unknown_path_and_a_trailing_slash_are_openais_404(local, no_generation, method, path):
    """A trailing slash was a bare 307 redirect to the path without it (a client that does not
    follow a POST's redirect saw an empty answer): it is a path no route has, like any other."""
    r = HTTP.request(method, f"{local.url}{path}", json=COMPLETION, headers=ADMIN, timeout=60,
                     follow_redirects=False)
    if path == "/v1/models/?":  # /v1/models/{model:path} with an empty id
        assert_error(r, 404, code="model_not_found", param="model")
        return
    err = assert_error(r, 404, code="not_found")
    assert path in err["message"], err
    if path.endswith("/"):
        assert "trailing slash" in err["message"], err


def test_routes_that_end_in_a_path_parameter_still_answer(local):
    assert HTTP.get(f"{local.url}/v1/models/{MODEL}").status_code == 200
    assert HTTP.get(f"{local.url}/dashboard/assets/dashboard.js").status_code == 200
    assert_error(HTTP.get(f"{local.url}/v1/models/org/{MODEL}/"), 404, code="model_not_found", param="model")


# ---- which error of a union's branches is reported --------------------------------------------------
@pytest.mark.parametrize("prompt,param,says", [
    ([1, "a"], "prompt.1", "valid integer"),  # was prompt.0 "should be a valid string": 1 is a fine token id
    ([1, 2, 2.5], "prompt.2", "valid integer"),
    (["a", 1], "prompt.1", "valid string"),
    (["a", "b", 3], "prompt.2", "valid string"),
    ([[1], [2, "x"]], "prompt.1.1", "valid integer"),
])
def test_a_bad_item_of_a_prompt_list_is_named_by_the_branch_its_other_items_match(local, no_generation, prompt,
                                                                                 param, says):
    err = assert_error(post(local.url, "/v1/completions", {**COMPLETION, "prompt": prompt}), 400,
                       code="invalid_value", param=param)
    assert says in err["message"], err
