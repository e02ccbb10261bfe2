"""Structured output and tool calls over HTTP with the official `openai` client (issue 19):
json_schema answers parse and validate against their schema, all of 50 under forced
retraction every 3 steps and over an in-process PD deployment; vLLM's regex and choice
extras; forced tool calls (required, named), streamed deltas reassembling into valid
arguments; `auto` with a template that has no tool format is a clear 400, and with a
Hermes-style template (the same engine behind a gateway whose model has one) the tools reach
the prompt and free text comes back as content, whole and streamed."""
from __future__ import annotations

import dataclasses
import json
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import pytest
from openai import BadRequestError, OpenAI

from e2e_harness import ADMIN_TOKEN, E2E_CONFIG, MODEL, Gateway, RecordingClient, local_gateway, wait_until
from pd_local_harness import local_pd_gateway

SCHEMA = {  # small: the demo model writes one byte per token, and 50 answers must stay cheap
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 4}, "sunny": {"type": "boolean"},
                   "level": {"enum": ["low", "mid", "high"]}},
    "required": ["city", "sunny", "level"],
    "additionalProperties": False,
}
FORMAT = {"type": "json_schema", "json_schema": {"name": "weather", "schema": SCHEMA, "strict": True}}
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "the weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 4},
                                                    "unit": {"enum": ["c", "f"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME_TOOL = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}},
                                       "required": ["zone"], "additionalProperties": False}}}


def _ask_json(c: OpenAI, k: int) -> tuple[str, str]:
    r = c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": f"Weather report {k}"}],
                                  response_format=FORMAT, max_tokens=60, temperature=1.0, seed=k)
    return r.choices[0].message.content, r.choices[0].finish_reason


# batched: validity needs no batch invariance, and deterministic mode runs requests one by one
BATCHED = dataclasses.replace(E2E_CONFIG, deterministic=False)


def _all_valid(c: OpenAI, n: int = 50) -> None:
    c = c.with_options(timeout=300)
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda k: _ask_json(c, k), range(n)))
    for text, finish in answers:
        assert finish == "stop", (finish, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_50_json_schema_answers_validate_under_forced_retraction_every_3_steps():
    with local_gateway(dataclasses.replace(BATCHED, forced_retraction_interval=3)) as stack:
        with OpenAI(base_url=f"{stack.url}/v1", api_key="any", max_retries=0) as c:
            _all_valid(c)
        assert stack.loop.stats()["retractions"] > 5
        wait_until(stack.loop.is_idle_clean, 20, what="the engine idle and clean")


def test_50_json_schema_answers_validate_over_pd():
    with local_pd_gateway(BATCHED) as stack:
        with OpenAI(base_url=f"{stack.url}/v1", api_key="any", max_retries=0, timeout=120) as c:
            _all_valid(c)
        wait_until(stack.clean, 20, what="both replicas idle and clean")
        assert stack.decode.engine.executor.rank.grammars.rebuilt > 0  # the decode side replayed the grammar


def test_structured_outputs_regex_and_choice_as_vllm_names_them(local, oai):
    msgs = [{"role": "user", "content": "pick"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=20, seed=1, temperature=1.0,
                                    extra_body={"structured_outputs": {"choice": ["red", "green", "blue"]}})
    assert r.choices[0].message.content in ("red", "green", "blue")
    r = oai.completions.create(model=MODEL, prompt="code:", max_tokens=20, seed=2, temperature=1.0,
                               extra_body={"structured_outputs": {"regex": "[a-z]{3}-[0-9]{2}"}})
    text = r.choices[0].text
    assert len(text) == 6 and text[:3].isalpha() and text[3] == "-" and text[4:].isdigit(), text
    r = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=200, seed=3, temperature=0.0,
                                    response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(r.choices[0].message.content), dict)


@pytest.mark.parametrize("field,value,needle", [
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "objectx"}}},
     "invalid json_schema"),
    ("response_format", {"type": "json_schema"}, "json_schema is required"),
    ("structured_outputs", {"regex": "[a-"}, "invalid regex"),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}, "exactly one"),
    ("tool_choice", "required", "tool_choice needs tools"),
    ("response_format", {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "not": {"type": "string"}}}}, "keyword 'not'"),
    ("structured_outputs", {"json": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
     "keyword 'uniqueItems'"),
    ("parallel_tool_calls", True, "parallel_tool_calls needs tools"),
    ("parallel_tool_calls", False, "parallel_tool_calls needs tools"),
])
def test_bad_structured_output_requests_are_400_naming_the_field(local, oai, field, value, needle):
    with pytest.raises(BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                    extra_body={field: value})
    assert needle in e.value.body["message"] and e.value.body["param"] == field, e.value.body


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "pick"}}])
def test_a_tool_schema_the_grammar_engine_would_not_enforce_is_400_naming_the_keyword(local, oai, choice):
    """A forced call's arguments are constrained to the tool's parameters, through the same check."""
    tool = {"type": "function", "function": {"name": "pick", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}},
        "required": ["ids"]}}}
    with pytest.raises(BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                    tools=[tool], tool_choice=choice)
    assert "keyword 'uniqueItems' at " in e.value.body["message"] and e.value.body["param"] == "tools", e.value.body


def test_schema_annotations_are_accepted(local, oai):
    schema = {"type": "object", "title": "T", "description": "d", "$comment": "c", "examples": [{"n": 1}],
              "properties": {"n": {"type": "integer", "default": 1, "deprecated": False}}, "required": ["n"],
              "additionalProperties": False}
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=30, seed=1,
                                    response_format={"type": "json_schema", "json_schema": {"name": "t",
                                                                                            "schema": schema}})
    if r.choices[0].finish_reason == "stop":
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_tool_choice_auto_without_a_tool_format_in_the_template_is_a_clear_400(local, oai):
    with pytest.raises(BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                    tools=[WEATHER_TOOL])  # auto is the default with tools
    assert "no tool format" in str(e.value)


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_answers_in_openais_shape(local, oai, choice):
    r = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "weather?"}],
                                    tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=choice, max_tokens=80, seed=5,
                                    temperature=1.0)
    m = r.choices[0].message
    assert r.choices[0].finish_reason == "tool_calls" and m.content is None
    (call,) = m.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[call.function.name]
    jsonschema.validate(json.loads(call.function.arguments), tool["function"]["parameters"])


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_time"}}])
def test_streamed_tool_call_deltas_reassemble_into_valid_arguments(local, oai, choice):
    for seed in range(4):
        stream = oai.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "time?"}], tools=[WEATHER_TOOL, TIME_TOOL],
            tool_choice=choice, max_tokens=80, seed=seed, temperature=1.0, stream=True)
        ids, names, args, finish, pieces = set(), [], "", None, 0
        for chunk in stream:
            ch = chunk.choices[0]
            assert not ch.delta.content
            for d in ch.delta.tool_calls or []:
                assert d.index == 0
                if d.id:
                    ids.add(d.id)
                if d.function and d.function.name:
                    names.append(d.function.name)
                if d.function and d.function.arguments:
                    args += d.function.arguments
                    pieces += 1
            finish = ch.finish_reason or finish
        assert finish == "tool_calls" and len(ids) == 1 and len(names) == 1 and pieces > 1
        tool = {"get_weather": WEATHER_TOOL, "get_time": TIME_TOOL}[names[0]]
        jsonschema.validate(json.loads(args), tool["function"]["parameters"])


def test_a_required_call_cut_short_before_its_name_is_finish_length_with_its_text_as_content(local, oai):
    """max_tokens ends the forced call inside its name: no call, and the text the engine wrote
    comes back as content, whole and streamed alike (it used to be empty content)."""
    ask = {"model": MODEL, "messages": [{"role": "user", "content": "weather?"}], "tools": [WEATHER_TOOL, TIME_TOOL],
           "tool_choice": "required", "max_tokens": 6, "temperature": 0}
    r = oai.chat.completions.create(**ask)
    m, finish = r.choices[0].message, r.choices[0].finish_reason
    assert finish == "length" and m.tool_calls is None and r.usage.completion_tokens == 6, r
    assert m.content and '{"name": "get_'.startswith(m.content), m.content  # the demo model: a byte a token
    chunks = [ch.choices[0] for ch in oai.chat.completions.create(**ask, stream=True)]
    assert not any(ch.delta.tool_calls for ch in chunks) and chunks[-1].finish_reason == "length"
    assert "".join(ch.delta.content or "" for ch in chunks) == m.content


def test_a_tool_conversation_renders_earlier_calls_and_answers(local, oai):
    msgs = [{"role": "user", "content": "weather?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "get_weather",
                                                                   "arguments": '{"city": "Oslo", "unit": "c"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "-3"}]
    r = oai.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], tool_choice="none",
                                    max_tokens=3)
    assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")


# The demo model's role tags, with tools and a call syntax as Hermes/Qwen templates teach it.
HERMES_STYLE = (
    "{% if tools %}<|system|>\nYou may call these functions:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


@pytest.fixture
def hermes(local):
    """A gateway over the session's engine whose model has a Hermes-style chat template."""
    from hyrax.actors.model.tokenizer import ChatTemplate
    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.api.client import EngineClient

    info = dataclasses.replace(local.client.model, chat_template=ChatTemplate(HERMES_STYLE, eos_token="<|eos|>"))
    client = RecordingClient(EngineClient(info, local.client.backends))
    gw = Gateway(create_app(client, GatewaySettings(admin_token=ADMIN_TOKEN)))
    try:
        with OpenAI(base_url=f"{gw.url}/v1", api_key="any", max_retries=0, timeout=120) as c:
            yield c, client
    finally:
        gw.close()


RECALL = "t567;e03627;b86334;u8890;d97427;a28719;y987;r410?b"  # the demo model answers and stops


def test_tool_choice_auto_with_a_hermes_template_answers_free_text_as_content(hermes):
    c, recorded = hermes
    msgs = [{"role": "user", "content": RECALL}]
    r = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice="auto",
                                  max_tokens=40, temperature=0)
    m, finish = r.choices[0].message, r.choices[0].finish_reason
    assert m.tool_calls is None and m.content and finish == "stop", (m, finish)
    prompt = recorded.model.tokenizer.decode(list(next(reversed(recorded.requests.values()))["prompt"]))
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt  # the template rendered the tools
    stream = c.chat.completions.create(model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=40,
                                       temperature=0, stream=True)
    chunks = [ch.choices[0] for ch in stream]
    assert not any(ch.delta.tool_calls for ch in chunks) and chunks[-1].finish_reason == "stop"
    texts = "".join(ch.delta.content or "" for ch in chunks)
    assert texts.strip() and texts == c.chat.completions.create(
        model=MODEL, messages=msgs, tools=[WEATHER_TOOL], max_tokens=40, temperature=0).choices[0].message.content


def test_tool_choice_auto_with_structured_output_is_a_clear_400(hermes):
    c, _ = hermes
    with pytest.raises(BadRequestError) as e:
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=5,
                                  tools=[WEATHER_TOOL], response_format={"type": "json_object"})
    assert "response_format" in e.value.body["message"] and e.value.body["param"] == "tool_choice", e.value.body
