"""Property-based API fuzz (issue 19): hypothesis builds request bodies for every POST route —
valid ones, valid ones with one field broken (wrong type, out of range, lone surrogates, NaN,
nulls, unknown or unsupported keys, missing keys), and raw non-JSON or non-object bodies, plus
structured output (response_format json_object / json_schema with and without strict,
structured_outputs choice / regex / json) and tools with every tool_choice, valid and malformed,
GETs of the other routes, with the admin token, none, or a wrong one — and sends them to the
gateway over the in-process engine. Over at least 1,000 requests: no 5xx,
every status is one the OpenAPI schema documents for that operation, and every JSON answer
validates against the schema it documents (errors against ErrorResponse, 200s against the
response schema where one is documented, streams as SSE ending in [DONE])."""
from __future__ import annotations

import json
import time

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from e2e_harness import ADMIN, HTTP, MODEL, sse_data

N_REQUESTS = 1100
SURROGATES = st.sampled_from(["\ud800", "a\udfff", "\udbffz"])
TEXT = st.one_of(st.text(max_size=12), SURROGATES)
SCALAR = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70), TEXT,
                   st.floats(allow_nan=True, allow_infinity=True))
ANY_JSON = st.recursive(SCALAR, lambda c: st.one_of(st.lists(c, max_size=3), st.dictionaries(TEXT, c, max_size=3)),
                        max_leaves=6)
# A broken value for a field that bounds work (tokens to generate, choices): anything but a
# valid large integer, so no fuzzed request runs for long.
CHEAP = ANY_JSON.filter(lambda v: not (isinstance(v, int) and not isinstance(v, bool) and 4 <= v <= 4096))
BOUNDED = {"max_tokens", "max_completion_tokens", "n", "min_tokens"}


def weighted(*choices):
    """One of (weight, strategy) pairs, drawn in proportion to the weights. (`st.one_of(a, a, b)`
    collapses the repeated strategy: it draws a and b about equally often.)"""
    table = [strategy for weight, strategy in choices for _ in range(weight)]
    return st.integers(0, len(table) - 1).flatmap(lambda i: table[i])


def texts(**kw):
    """Mostly valid text; one draw in six is a string with a lone surrogate."""
    return weighted((5, st.text(**kw)), (1, SURROGATES))


PROMPT = st.one_of(texts(min_size=1, max_size=20), st.lists(texts(min_size=1, max_size=8), min_size=1, max_size=2),
                   st.lists(st.integers(0, 263), min_size=1, max_size=8))
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant", "developer"]),
                                 "content": st.one_of(texts(max_size=20), st.lists(st.fixed_dictionaries(
                                     {"type": st.just("text"), "text": texts(max_size=8)}), max_size=2))})
SAMPLING = {  # valid values of the optional sampling fields
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(0, 2**31), "stop": st.one_of(texts(min_size=1, max_size=4),
                                                      st.lists(texts(min_size=1, max_size=4), max_size=3)),
    "n": st.integers(1, 2), "stream": st.booleans(), "ignore_eos": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "repetition_penalty": st.floats(0.5, 2),
    "logit_bias": st.dictionaries(st.integers(0, 263).map(str), st.floats(-100, 100), max_size=3),
    "min_tokens": st.integers(0, 1), "stop_token_ids": st.lists(st.integers(0, 263), max_size=2),
    "user": texts(max_size=8),
}
# Structured output and tools: mostly valid values (which may still be a 400: auto on the demo's
# template, a grammar beside ignore_eos), one draw in four malformed but of the right outer type.
def mostly(valid, malformed):
    return weighted((3, valid), (1, malformed))


WORDS = st.text(alphabet="abcxyz", min_size=1, max_size=4)
GOOD_SCHEMAS = st.sampled_from([
    {}, {"type": "object"}, {"type": "string", "maxLength": 3}, {"enum": ["a", "b"]},
    {"type": "object", "properties": {"x": {"type": "integer"}, "y": {"type": "boolean"}}, "required": ["x"]},
    {"type": "array", "items": {"type": "number"}, "maxItems": 2},
])
BAD_SCHEMAS = st.sampled_from([{"type": "objectx"}, {"type": "string", "pattern": "[a-"}, {"$ref": "#/nowhere"},
                               {"minimum": "zero"}, {"type": ["string", 7]}])
SCHEMAS = mostly(GOOD_SCHEMAS, BAD_SCHEMAS)
RESPONSE_FORMAT = mostly(
    st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}), st.fixed_dictionaries(
        {"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": st.just("answer"), "schema": GOOD_SCHEMAS}, optional={"strict": st.booleans()})})),
    st.one_of(
        st.sampled_from([{"type": "json_schema"}, {"type": "json_object", "json_schema": {"name": "x"}},
                         {"type": "xml"}, {}, {"type": "json_schema", "json_schema": {"schema": {}}}]),
        st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
            {"name": texts(max_size=70), "schema": SCHEMAS}, optional={"strict": ANY_JSON})})),
)
REGEXES = st.sampled_from(["[a-z]{1,3}", "(yes|no)", "[0-9]+", ".*"])
STRUCTURED_OUTPUTS = mostly(
    st.one_of(st.fixed_dictionaries({"choice": st.lists(WORDS, min_size=1, max_size=3)}),
              st.fixed_dictionaries({"regex": REGEXES}),
              st.fixed_dictionaries({"json": st.one_of(GOOD_SCHEMAS, GOOD_SCHEMAS.map(json.dumps))})),
    st.one_of(st.sampled_from([{"regex": "[a-"}, {"regex": "a{2,1}"}, {"choice": []}, {"choice": [""]},
                               {"regex": "a", "choice": ["a"]}, {}, {"json": "{not json"}, {"json": "[1]"}]),
              st.fixed_dictionaries({"json": BAD_SCHEMAS}), st.fixed_dictionaries({"choice": st.lists(TEXT)})),
)
GOOD_TOOL = st.fixed_dictionaries(
    {"type": st.just("function"), "function": st.fixed_dictionaries(
        {"name": st.sampled_from(["get_weather", "get_time"])},
        optional={"parameters": GOOD_SCHEMAS, "description": texts(max_size=8), "strict": st.booleans()})})
BAD_TOOL = st.one_of(
    GOOD_TOOL.map(lambda t: {**t, "type": "retrieval"}),
    st.sampled_from(["bad name!", "", "x" * 65]).map(lambda n: {"type": "function", "function": {"name": n}}),
    BAD_SCHEMAS.map(lambda p: {"type": "function", "function": {"name": "f", "parameters": p}}),
    st.just({"type": "function"}), st.just({"type": "function", "function": {"name": "f", "parameters": []}}))
NAMED = st.sampled_from(["get_weather", "get_time"]).map(lambda n: {"type": "function", "function": {"name": n}})
TOOL_CHOICE = mostly(
    st.one_of(st.sampled_from(["none", "auto", "required"]), NAMED),
    st.sampled_from(["sometimes", {"type": "function"}, {"type": "function", "function": {"name": "nope"}}]))
GRAMMARS = {"response_format": RESPONSE_FORMAT, "structured_outputs": STRUCTURED_OUTPUTS}
TOOLS = {"tools": mostly(st.lists(GOOD_TOOL, min_size=1, max_size=2, unique_by=lambda t: t["function"]["name"]),
                         st.lists(st.one_of(GOOD_TOOL, BAD_TOOL), min_size=2, max_size=2)),
         "tool_choice": TOOL_CHOICE,
         "parallel_tool_calls": st.booleans()}
ROUTES = {  # path -> (required fields, optional fields), each with a strategy of valid values
    "/v1/completions": ({"model": st.just(MODEL), "prompt": PROMPT, "max_tokens": st.integers(1, 3)},
                        {**SAMPLING, **GRAMMARS, "echo": st.booleans(), "logprobs": st.integers(0, 3)}),
    "/v1/chat/completions": ({"model": st.just(MODEL), "messages": st.lists(MESSAGE, min_size=1, max_size=3),
                              "max_tokens": st.integers(1, 3)},
                             {**SAMPLING, **GRAMMARS, **TOOLS, "logprobs": st.booleans(),
                              "top_logprobs": st.integers(0, 3)}),
    "/v1/tokenize": ({"prompt": texts(max_size=20)}, {"model": st.just(MODEL)}),  # add_generation_prompt: messages
    "/v1/detokenize": ({"tokens": st.lists(st.integers(0, 263), max_size=8)}, {"model": st.just(MODEL)}),
    "/admin/retract": ({"request_ids": st.lists(texts(max_size=8), max_size=2)},
                       {"mode": st.sampled_from(["cpu_tensor", "host_pool", "recompute"]), "hold": st.just(False)}),
    "/admin/resume": ({"request_ids": st.lists(texts(max_size=8), min_size=1, max_size=2)}, {}),
    "/admin/forced-retraction": ({"interval": st.integers(0, 5)}, {}),
    "/admin/migrate": ({"request_id": texts(max_size=8)}, {}),
}
UNKNOWN_KEYS = st.one_of(TEXT, st.sampled_from(["response_format", "tools", "tool_choice", "best_of", "suffix",
                                                "min_p", "functions", "store", "echo", "prompt", "messages",
                                                "guided_json", "structured_outputs"]))


@st.composite
def body(draw, path: str):
    required, optional = ROUTES[path]
    b = {k: draw(s) for k, s in required.items()}
    for k in draw(st.lists(st.sampled_from(sorted(optional)), max_size=4, unique=True)) if optional else []:
        b[k] = draw(optional[k])
    extra = draw(st.sampled_from(["tools", "grammar", "none"])) if set(GRAMMARS) <= set(optional) else "none"
    if extra == "tools" and "tools" in optional:  # tool_choice mostly given: auto (the default) is a 400 here
        b.update(draw(st.fixed_dictionaries(
            {"tools": TOOLS["tools"], "tool_choice": weighted((3, TOOL_CHOICE), (1, st.none()))},
            optional={"parallel_tool_calls": TOOLS["parallel_tool_calls"]})))
    elif extra != "none":
        k = draw(st.sampled_from(sorted(GRAMMARS)))
        b[k] = draw(GRAMMARS[k])
    how = draw(st.sampled_from(["valid"] * 4 + ["break"] * 2 + ["unknown", "drop"]))
    if how == "break":
        k = draw(st.sampled_from(sorted(set(required) | set(optional))))
        b[k] = draw(CHEAP if k in BOUNDED else ANY_JSON)
    elif how == "unknown":
        b[draw(UNKNOWN_KEYS)] = draw(ANY_JSON)
    elif how == "drop":
        k = draw(st.sampled_from(sorted(set(required) - {"max_tokens"})))
        b.pop(k, None)
    return b


RAW = st.one_of(st.binary(max_size=30), ANY_JSON.map(lambda v: json.dumps(v).encode()),
                st.just(b'{"model": "hyrax-demo", "prompt": "\\ud800'), st.just(b'{"prompt": NaN}'))
POSTS = st.one_of(
    st.sampled_from(sorted(ROUTES)).flatmap(lambda p: st.tuples(st.just("post"), st.just(p), body(p).map(
        lambda b: json.dumps(b, allow_nan=True).encode()))),
    st.tuples(st.just("post"), st.sampled_from(sorted(ROUTES)), RAW),
)
GETS = st.tuples(st.just("get"), st.one_of(
    st.sampled_from(["/v1/models", "/admin/requests", "/admin/pools", "/health", "/version"]),
    st.text(alphabet="abcdefghijklmnopqrstuvwxyz.-_", max_size=12).map(lambda n: f"/dashboard/assets/{n or 'x'}"),
), st.just(b""))
AUTH = st.sampled_from(["admin", "admin", "admin", "admin", "none", "wrong"])
REQUEST = st.tuples(weighted((4, POSTS), (1, GETS)), AUTH)
HEADERS = {"admin": ADMIN, "none": {}, "wrong": {"Authorization": "Bearer not-the-token"}}


class Checker:
    """Validates answers against the server's own OpenAPI document."""

    def __init__(self, schema: dict):
        self.schema = schema
        self.seen: dict[int, int] = {}

    def _validate(self, instance, ref: dict) -> None:
        jsonschema.validate(instance, {**ref, "components": self.schema["components"]})

    def check(self, method: str, path: str, r: httpx.Response) -> None:
        self.seen[r.status_code] = self.seen.get(r.status_code, 0) + 1
        assert r.status_code < 500, (path, r.status_code, r.text)
        if path.startswith("/dashboard/assets/"):
            path = "/dashboard/assets/{name}"
        documented = self.schema["paths"][path][method]["responses"]
        assert str(r.status_code) in documented, (path, r.status_code, r.text, sorted(documented))
        content = documented[str(r.status_code)].get("content", {})
        if r.headers["content-type"].startswith("text/event-stream"):
            assert "text/event-stream" in content, path
            events = sse_data(r.text.splitlines())
            assert events and events[-1] == "[DONE]", r.text
            for e in events[:-1]:
                assert isinstance(e, dict) and "choices" in e, e
            return
        doc = content.get("application/json", {}).get("schema")
        if doc:
            self._validate(r.json(), doc)
        elif r.headers["content-type"].startswith("application/json"):
            r.json()


@pytest.fixture
def checker(local):
    return Checker(HTTP.get(f"{local.url}/openapi.json").json())


def test_fuzzed_requests_get_no_5xx_and_match_the_documented_schema(local, checker):
    sent, covered = [], {}  # covered: (structured-output or tool field, status) -> requests
    http = httpx.Client(base_url=local.url, timeout=60)

    @settings(max_examples=N_REQUESTS, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(REQUEST)
    def one(req):
        (method, path, content), auth = req
        headers = {"Content-Type": "application/json", **HEADERS[auth]}
        r = http.request(method.upper(), path, content=content or None, headers=headers)
        checker.check(method, path, r)
        sent.append(path)
        try:
            sent_body = json.loads(content)
        except ValueError:
            return
        for k in (set(GRAMMARS) | set(TOOLS)) & set(sent_body if isinstance(sent_body, dict) else ()):
            covered[k, r.status_code] = covered.get((k, r.status_code), 0) + 1

    cpu = time.process_time()
    try:
        one()
    finally:
        http.close()
    cpu = time.process_time() - cpu
    assert len(sent) >= 1000, len(sent)
    assert checker.seen.get(200, 0) >= 200 and checker.seen.get(400, 0) >= 200, checker.seen  # both kinds exercised
    assert set(ROUTES) <= set(sent) and checker.seen.get(401, 0) >= 50, checker.seen
    for k in (*GRAMMARS, "tools", "tool_choice"):  # each sent in requests that were served and in ones refused
        assert covered.get((k, 200), 0) >= 5 and covered.get((k, 400), 0) >= 5, (k, covered)
    print(f"fuzz: {len(sent)} requests, statuses {checker.seen}, {cpu:.1f} s CPU; structured output and tools: "
          f"{dict(sorted(covered.items()))}")
