"""Tools an unlucky or hostile client sends with a forced call (`required` or a named function):
OpenAI's `function.arguments` is a JSON object, so a `parameters` schema whose values need not be
objects is a 400 naming the tool's field. Before, it was accepted and the call's arguments came
back as a JSON string, number or list (`"arguments": "\\"IHGFE\\""`)."""
from __future__ import annotations

import pytest

from hyrax.api.errors import APIError
from hyrax.api.schemas import ChatRequest
from hyrax.api.tools import plan_tools

OBJ = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}


def _body(params: list, choice) -> ChatRequest:
    tools = [{"type": "function", "function": {"name": f"f{i}", **({} if p is None else {"parameters": p})}}
             for i, p in enumerate(params)]
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": tools,
                                       "tool_choice": choice})


NAMED_1 = {"type": "function", "function": {"name": "f1"}}


@pytest.mark.parametrize("params", [{"type": "string", "maxLength": 5}, {"enum": ["a", "b"]},
                                    {"type": "array", "items": {"type": "integer"}}, {"type": ["object", "null"]},
                                    {"anyOf": [OBJ, {"type": "integer"}]}, {"const": 3},
                                    {"$ref": "#/$defs/a", "$defs": {"a": OBJ}}])
@pytest.mark.parametrize("choice", ["required", NAMED_1])
def test_forced_call_parameters_that_are_not_an_object_schema_are_a_400_naming_the_tool(params, choice):
    with pytest.raises(APIError) as e:
        plan_tools(_body([OBJ, params], choice), None)
    assert e.value.status == 400 and e.value.param == "tools.1.function.parameters", (e.value.param, e.value.message)
    assert "object" in e.value.message


@pytest.mark.parametrize("params", [None, {}, {"type": "object"}, OBJ, {"type": ["object"]},
                                    {"properties": {"x": {"type": "integer"}}},
                                    {"type": "object", "additionalProperties": {"type": "string"}, "title": "t"}])
@pytest.mark.parametrize("choice", ["required", NAMED_1])
def test_forced_call_parameters_of_an_object_are_planned(params, choice):
    assert plan_tools(_body([OBJ, params], choice), None).forced


def test_a_tool_the_forced_call_cannot_choose_is_not_checked():
    """A named function constrains only its own arguments: another tool's schema is the template's."""
    assert plan_tools(_body([{"type": "string"}, OBJ], NAMED_1), None).forced


# A tool's parameters with references inside themselves, as pydantic writes nested models: under
# `required` they sit inside the anyOf of calls, where "#" is that anyOf's root. Before, "#/$defs/.."
# was a 400 (nothing at that path) and "#" silently meant a whole call body instead of the tool's
# arguments.
NESTED = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"], "$id": "urn:args",
          "$defs": {"Loc": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 8}},
                            "required": ["city"], "additionalProperties": False}},
          "additionalProperties": False}
LINKED = {"type": "object", "properties": {"n": {"type": "integer"},
                                           "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]},
                                           "also": {"$ref": "#/properties/n"},
                                           "note": {"const": {"$ref": "#"}}},
          "required": ["n", "next", "also", "note"], "additionalProperties": False}


def _accepts(spec, text: str) -> bool:
    xgr = pytest.importorskip("xgrammar")
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(spec._grammar())
    m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return m.accept_string(text) and m.is_terminated()


def test_required_keeps_each_tools_references_inside_its_own_arguments():
    plan = plan_tools(_body([NESTED, LINKED], "required"), None)
    g = plan.grammar
    assert _accepts(g, '{"name": "f0", "arguments": {"loc": {"city": "Oslo"}}}')
    assert not _accepts(g, '{"name": "f0", "arguments": {"loc": {"town": "Oslo"}}}')
    note = '"note": {"$ref":"#"}'  # xgrammar writes a const object compactly
    link = '{"n": 2, "next": null, "also": 3, ' + note + '}'
    assert _accepts(g, '{"name": "f1", "arguments": {"n": 1, "next": ' + link + ', "also": 5, ' + note + '}}')
    assert not _accepts(g, '{"name": "f1", "arguments": {"n": 1, "next": {"name": "f1", "arguments": ' + link +
                        '}, "also": 5, ' + note + '}}')
    assert not _accepts(g, '{"name": "f1", "arguments": {"n": 1, "next": null, "also": "x", ' + note + '}}')
    assert '"note": {"const": {"$ref": "#"}}' in g.source  # data, not a reference: kept as it is


def test_a_named_function_with_references_is_planned_as_it_was():
    assert _accepts(plan_tools(_body([OBJ, NESTED], NAMED_1), None).grammar, '{"loc": {"city": "Oslo"}}')
