"""Bad requests on every endpoint get the right status in OpenAI's error shape
{"error": {"message", "type", "param", "code"}}, without server internals, start no
generation, and leave the server answering /health."""
from __future__ import annotations

import pytest

from e2e_harness import ADMIN, HTTP, MODEL, assert_error, routes

COMPLETION = {"model": MODEL, "prompt": "hi", "max_tokens": 4}
CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
BASE = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}
SAMPLING_ERRORS = [  # (field, bad value) valid for both generation endpoints
    ("max_tokens", "x"), ("max_tokens", 0), ("max_tokens", -5), ("max_tokens", 1.5),
    ("temperature", -1), ("temperature", "hot"), ("top_p", 0), ("top_p", 1.5), ("top_k", -2),
    ("n", 0), ("n", 1000), ("seed", "abc"), ("stop", 5), ("stream", {"x": 1}),
    ("stream_options", "yes"), ("model", 7),
]


@pytest.fixture(autouse=True)
def still_healthy(local):
    """Every case leaves the server answering (and, by `local`, the engine idle and clean)."""
    yield
    assert HTTP.get(f"{local.url}/health").status_code == 200


@pytest.fixture
def no_generation(local):
    """The rejected requests never reach the engine."""
    before = len(local.client.requests)
    yield
    assert len(local.client.requests) == before, "a rejected request reached the engine"


def post(local, path, body=None, content=None, headers=None):
    return HTTP.post(f"{local.url}{path}", json=body, content=content, timeout=30,
                      headers={**(ADMIN if path.startswith("/admin") else {}), **(headers or {})})


def test_bad_json_is_400_on_every_post_endpoint(local, no_generation):
    paths = [path for method, path in routes(local.app) if method == "POST"]
    assert {"/v1/completions", "/v1/chat/completions", "/admin/retract", "/admin/resume"} <= set(paths)
    for path in paths:
        # JSON syntax around bytes that are no UTF-8 (FastAPI's own 400 for it said "There was an
        # error parsing the body", code null); a key twice (every JSON route reads bodies strictly)
        for raw in (b'{"model": "hyrax-demo", "prompt": ', b"\xff\xfe", b"[1, 2", b'{"prompt": "\xff\xfeab"}',
                    b'{"all": true, "all": true}'):
            r = post(local, path, content=raw, headers={"Content-Type": "application/json"})
            assert_error(r, 400, code="invalid_json")


def test_a_body_that_is_no_json_object_says_how_to_send_one(local, no_generation):
    """`curl -d` without a header sends form encoding, which is not parsed as JSON; an array or
    a scalar is JSON but no request. The 400 says what the body must be, not pydantic's words."""
    body = b'{"model": "hyrax-demo", "prompt": "x", "max_tokens": 1}'
    for path in ("/v1/completions", "/v1/chat/completions", "/admin/retract", "/v1/tokenize"):
        for raw, ctype in ((body, "application/x-www-form-urlencoded"), (body, "text/plain"),
                           (b"[1, 2]", "application/json"), (b'"text"', "application/json")):
            err = assert_error(post(local, path, content=raw, headers={"Content-Type": ctype}), 400,
                               code="invalid_json")
            assert "must be a JSON object" in err["message"] and "Content-Type: application/json" in err["message"]
            assert "dictionary" not in err["message"], err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("field,value", SAMPLING_ERRORS, ids=[f"{f}={v!r}" for f, v in SAMPLING_ERRORS])
def test_wrong_type_or_out_of_range_sampling_field_is_400(local, no_generation, path, field, value):
    for stream in (False, True):  # a streaming request fails before any event is sent
        r = post(local, path, {**BASE[path], "stream": stream, field: value})
        err = assert_error(r, 400)
        assert err["type"] == "invalid_request_error"
        assert err["param"] is not None and err["param"].split(".")[0] == field, err


@pytest.mark.parametrize("path,patch,param", [
    ("/v1/completions", {"prompt": None}, "prompt"),
    ("/v1/completions", {"prompt": 123}, "prompt"),
    ("/v1/completions", {"prompt": ""}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": [[]]}, "prompt"),
    ("/v1/completions", {"prompt": [1, "a"]}, "prompt"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"max_completion_tokens": 0}, "max_completion_tokens"),
])
def test_malformed_prompt_or_messages_is_400(local, no_generation, path, patch, param):
    body = {k: v for k, v in {**BASE[path], **patch}.items() if v is not None}
    err = assert_error(post(local, path, body), 400)
    assert err["param"] is not None and err["param"].split(".")[0] == param, err


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_missing_model_is_400_and_unknown_model_is_404(local, no_generation, path):
    body = dict(BASE[path])
    del body["model"]
    assert_error(post(local, path, body), 400, param="model")
    err = assert_error(post(local, path, {**BASE[path], "model": "gpt-4"}), 404, code="model_not_found", param="model")
    assert err["type"] == "not_found_error"


def test_unknown_model_raises_not_found_in_the_openai_client(oai):
    import openai

    with pytest.raises(openai.NotFoundError):
        oai.completions.create(model="nope", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        oai.completions.create(model=MODEL, prompt="hi", max_tokens=0)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_prompt_longer_than_the_context_is_400(local, no_generation, path):
    ctx = local.client.model.max_model_len
    if path == "/v1/completions":
        too_long = {"prompt": [65] * ctx}
        fits_alone = {"prompt": [65] * (ctx - 10), "max_tokens": 100}
    else:
        too_long = {"messages": [{"role": "user", "content": "A" * ctx}]}
        fits_alone = {"messages": [{"role": "user", "content": "A" * (ctx - 40)}], "max_tokens": 100}
    assert_error(post(local, path, {**BASE[path], **too_long}), 400, code="context_length_exceeded",
                 param="prompt" if path == "/v1/completions" else "messages")
    assert_error(post(local, path, {**BASE[path], **fits_alone}), 400, code="context_length_exceeded",
                 param="max_tokens")


@pytest.mark.parametrize("prompt", [[264], [-1], [1, 2, 10**6], [[1, 2], [999]]], ids=str)
def test_prompt_token_id_outside_the_vocabulary_is_400(local, no_generation, prompt):
    assert local.client.model.vocab_size == 264
    assert_error(post(local, "/v1/completions", {**COMPLETION, "prompt": prompt}), 400, param="prompt")


@pytest.mark.parametrize("path,body,param", [
    ("/admin/retract", {}, None),
    ("/admin/retract", {"all": True, "count": 1}, None),
    ("/admin/retract", {"count": 0}, "count"),
    ("/admin/retract", {"count": "x"}, "count"),
    ("/admin/retract", {"request_ids": "req-1"}, "request_ids"),
    ("/admin/retract", {"all": True, "mode": "bogus"}, "mode"),
    ("/admin/retract", {"all": True, "hold": "maybe"}, "hold"),
    ("/admin/retract", {"all": True, "extra": 1}, "extra"),
    ("/admin/resume", {}, None),  # exactly one of request_ids, count, all
    ("/admin/resume", {"request_ids": []}, "request_ids"),
    ("/admin/resume", {"request_ids": [1]}, "request_ids"),
    ("/admin/forced-retraction", {"interval": -1}, "interval"),
    ("/admin/forced-retraction", {"interval": "x"}, "interval"),
    ("/admin/forced-retraction", {}, "interval"),
])
def test_invalid_admin_body_is_400(local, no_generation, path, body, param):
    err = assert_error(post(local, path, body), 400)
    if param is not None:
        assert err["param"] is not None and err["param"].split(".")[0] == param, err


def test_unknown_path_is_404_and_wrong_method_is_405_in_error_shape(local):
    assert_error(HTTP.get(f"{local.url}/v1/nope"), 404)
    assert_error(HTTP.post(f"{local.url}/v2/completions", json=COMPLETION), 404)
    assert_error(HTTP.get(f"{local.url}/v1/completions"), 405)
    assert_error(HTTP.delete(f"{local.url}/v1/models"), 405)
    assert_error(HTTP.get(f"{local.url}/admin/retract", headers=ADMIN), 405)


def test_oversized_body_is_413_with_or_without_content_length(local, gateway_with):
    url = gateway_with(max_body_bytes=2048)
    small = {**COMPLETION, "prompt": "x" * 1000}
    big = {**COMPLETION, "prompt": "x" * 4000}
    assert HTTP.post(f"{url}/v1/completions", json=small).status_code == 200
    assert_error(HTTP.post(f"{url}/v1/completions", json=big), 413, code="body_too_large")
    assert_error(HTTP.post(f"{url}/v1/chat/completions", json={**CHAT, "messages": [
        {"role": "user", "content": "y" * 4000}]}), 413, code="body_too_large")
    assert_error(HTTP.post(f"{url}/admin/retract", json={"request_ids": ["r" * 4000]}, headers=ADMIN), 413)

    import json

    def chunked(body):  # no Content-Length: the limit is enforced while reading
        data = json.dumps(body).encode()
        for i in range(0, len(data), 512):
            yield data[i:i + 512]

    r = HTTP.post(f"{url}/v1/completions", content=chunked(big), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert_error(r, 413, code="body_too_large")
    # a chunked body within the limit reaches the route whole, as it was sent
    r = HTTP.post(f"{url}/v1/completions", content=chunked(small), headers={"Content-Type": "application/json"})
    assert "content-length" not in r.request.headers
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] > 0
    assert HTTP.get(f"{url}/health").status_code == 200


def test_api_keys_guard_v1_routes_when_configured(local, gateway_with):
    import openai

    url = gateway_with(api_keys=("k1", "k2"))
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": "k1"}, {"Authorization": "Bearer k1x"},
                    {"Authorization": "Basic k1"}):
        assert_error(HTTP.get(f"{url}/v1/models", headers=headers), 401, code="invalid_api_key")
        err = assert_error(HTTP.post(f"{url}/v1/completions", json=COMPLETION, headers=headers), 401)
        assert err["type"] == "authentication_error"
        assert_error(HTTP.post(f"{url}/v1/chat/completions", json=CHAT, headers=headers), 401)
    for key in ("k1", "k2"):
        ok = {"Authorization": f"Bearer {key}"}
        assert HTTP.get(f"{url}/v1/models", headers=ok).status_code == 200
        assert HTTP.post(f"{url}/v1/completions", json=COMPLETION, headers=ok).status_code == 200
        assert HTTP.post(f"{url}/v1/chat/completions", json=CHAT, headers=ok).status_code == 200
    assert HTTP.get(f"{url}/health").status_code == 200  # probes need no key
    assert HTTP.get(f"{url}/version").status_code == 200

    with openai.OpenAI(base_url=f"{url}/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            bad.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="k1", max_retries=0) as good:
        assert good.completions.create(model=MODEL, prompt="hi", max_tokens=2).choices[0].finish_reason


def test_health_and_version_answer(local):
    h = HTTP.get(f"{local.url}/health")
    assert h.status_code == 200 and h.json()["status"] == "ok"
    v = HTTP.get(f"{local.url}/version").json()
    assert v["model"] == MODEL and v["version"]


@pytest.mark.parametrize("stop", ["", ["ok", ""]], ids=repr)
def test_empty_stop_string_is_400_streaming_or_not(local, stop):
    for stream in (False, True):
        r = post(local, "/v1/completions", {**COMPLETION, "stop": stop, "stream": stream})
        err = assert_error(r, 400)
        assert err["param"] == "stop", err


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
@pytest.mark.parametrize("extreme", [{"temperature": 1.0, "top_p": 1e-50}, {"temperature": 1e-40}], ids=str)
def test_extreme_sampling_values_do_not_wedge_the_engine(extreme):
    from e2e_harness import E2E_CONFIG, local_gateway

    with local_gateway(E2E_CONFIG) as own:  # its own engine: a wedged one must not stall the suite
        try:
            r = HTTP.post(f"{own.url}/v1/completions", json={**COMPLETION, **extreme}, timeout=5)
            assert r.status_code in (200, 400), r.text
            after = HTTP.post(f"{own.url}/v1/completions", json=COMPLETION, timeout=5)
            assert after.status_code == 200, after.text
        finally:
            alive = own.loop.thread.is_alive()
        assert alive, "the engine loop thread died"
