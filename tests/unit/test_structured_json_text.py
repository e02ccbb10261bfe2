"""vLLM's `structured_outputs.json` given as JSON text is read as strictly as a request body: a key
given twice in one object is a 400 naming it (before, json.loads kept the last one silently: the
answer followed a schema the client did not send in full), and text nested deeper than the
parser goes is a 400 (before, a RecursionError: a 500)."""
from __future__ import annotations

import pytest

from hyrax.api.errors import APIError
from hyrax.api.schemas import ChatRequest
from hyrax.api.structured import grammar_of


def _grammar(text: str):
    return grammar_of(ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}],
                                                  "structured_outputs": {"json": text}}))


@pytest.mark.parametrize("text,key", [
    ('{"type": "string", "type": "integer"}', "type"),
    ('{"type": "object", "properties": {"a": {"type": "integer"}, "a": {"type": "string"}}}', "a"),
])
def test_a_key_twice_in_the_schema_text_is_a_400_naming_it(text, key):
    with pytest.raises(APIError) as e:
        _grammar(text)
    assert e.value.status == 400 and e.value.param == "structured_outputs", e.value.param
    assert f"{key!r} appears twice" in e.value.message, e.value.message


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a": ' * 100_000 + "1" + "}" * 100_000])
def test_schema_text_nested_too_deeply_is_a_400(text):
    with pytest.raises(APIError) as e:
        _grammar(text)
    assert e.value.status == 400 and e.value.param == "structured_outputs" and "deeply" in e.value.message


@pytest.mark.parametrize("text", ["{not json", '{"type": "string"} trailing', "", '{"maxLength": 1' + "0" * 5000 + "}"])
def test_schema_text_that_is_not_json_is_a_400(text):
    with pytest.raises(APIError) as e:
        _grammar(text)
    assert e.value.status == 400 and e.value.param == "structured_outputs", e.value.param


def test_schema_text_that_is_a_schema_is_read():
    spec = _grammar(' {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]} ')
    assert spec is not None and '"required": ["a"]' in spec.source
