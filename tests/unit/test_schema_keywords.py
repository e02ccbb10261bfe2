"""Which JSON-Schema keywords the grammar engine enforces (hyrax/actors/engine/schema_keywords.py),
measured against the installed xgrammar: every keyword on the allow-list tells a value that
keeps it from one that breaks it, and every schema Hyrax refuses is one where xgrammar accepts a
value that breaks the schema (so the refusal is needed, and an xgrammar upgrade that starts
enforcing it is noticed). Before, such schemas compiled and the answers broke them."""
from __future__ import annotations

import json

import jsonschema
import pytest

from hyrax.actors.engine.grammar import GrammarSpec
from hyrax.actors.engine.schema_keywords import ANNOTATIONS, FORMATS, KEYWORD_TYPE, check_schema
from hyrax.actors.model.errors import HyraxInputError

xgr = pytest.importorskip("xgrammar")
INT = {"type": "integer"}


def xgrammar_accepts(schema: dict, value, strict: bool = True) -> bool:
    """Whether xgrammar's matcher takes `value`, written as Hyrax has it write JSON."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=strict)
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(grammar)
    matcher = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return matcher.accept_string(json.dumps(value)) and matcher.is_terminated()


def breaks(schema: dict, value) -> bool:
    """Whether `value` breaks `schema` by JSON Schema (draft 2020-12, formats asserted)."""
    v = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    return not v.is_valid(value)


# keyword -> (schema using it, a value it accepts, a value that breaks the keyword)
ENFORCED = {
    "type": (INT, 5, "a"),
    "enum": ({"type": "string", "enum": ["a", "b"]}, "a", "c"),
    "const": ({"const": "a"}, "a", "b"),
    "anyOf": ({"anyOf": [INT, {"type": "null"}]}, None, "a"),
    "oneOf": ({"oneOf": [INT, {"type": "string"}, {"const": True}]}, "x", False),
    "allOf": ({"allOf": [{"type": "integer", "minimum": 3}]}, 3, 2),
    "$ref": ({"$ref": "#/$defs/x", "$defs": {"x": INT}}, 1, "a"),
    "$defs": ({"type": "object", "properties": {"a": {"$ref": "#/$defs/x"}}, "required": ["a"],
               "$defs": {"x": INT}}, {"a": 1}, {"a": "x"}),
    "definitions": ({"$ref": "#/definitions/x", "definitions": {"x": INT}}, 1, "a"),
    "minimum": ({"type": "number", "minimum": 3.5}, 3.5, 2.5),
    "maximum": ({"type": ["integer", "null"], "maximum": 3}, 3, 4),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, 4, 3),
    "exclusiveMaximum": ({"type": "number", "exclusiveMaximum": 3.5}, 3.25, 3.5),
    "multipleOf": ({"type": "integer", "multipleOf": 3}, 6, 5),
    "minLength": ({"type": "string", "minLength": 2, "maxLength": 3}, "ab", "a"),
    "maxLength": ({"type": "string", "maxLength": 2}, "ab", "abc"),
    "pattern": ({"type": "string", "pattern": "^a+$"}, "aa", "b"),
    "format": ({"type": "string", "format": "date"}, "2024-01-02", "nope"),
    "items": ({"items": INT}, [1], ["a"]),
    "prefixItems": ({"type": "array", "prefixItems": [INT], "items": False}, [1], ["a"]),
    "unevaluatedItems": ({"type": "array", "prefixItems": [INT], "unevaluatedItems": False}, [1], [1, 2]),
    "minItems": ({"type": "array", "items": INT, "minItems": 2}, [1, 2], [1]),
    "maxItems": ({"type": "array", "items": INT, "maxItems": 1}, [1], [1, 2]),
    "properties": ({"properties": {"a": INT}}, {"a": 1}, {"a": "x"}),
    "required": ({"type": "object", "properties": {"a": INT, "b": INT}, "required": ["a"]}, {"a": 1}, {"b": 1}),
    "additionalProperties": ({"type": "object", "additionalProperties": INT}, {"b": 1}, {"b": "x"}),
    "unevaluatedProperties": ({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": INT},
                              {"a": 1, "b": 2}, {"a": 1, "b": "x"}),
    "patternProperties": ({"type": "object", "patternProperties": {"^a.*$": INT}}, {"ab": 1}, {"ab": "x"}),
    "propertyNames": ({"type": "object", "propertyNames": {"maxLength": 1}, "additionalProperties": INT},
                      {"a": 1}, {"bb": 1}),
    "minProperties": ({"type": "object", "additionalProperties": INT, "minProperties": 1}, {"a": 1}, {}),
    "maxProperties": ({"type": "object", "additionalProperties": INT, "maxProperties": 1}, {"a": 1}, {"a": 1, "b": 2}),
}
FORMAT_VALUES = {
    "date": "2024-01-02", "time": "03:04:05Z", "date-time": "2024-01-02T03:04:05Z", "duration": "P1D",
    "email": "a@b.co", "hostname": "a.b", "ipv4": "1.2.3.4", "ipv6": "::1",
    "uuid": "123e4567-e89b-12d3-a456-426614174000", "uri": "http://a.b/c", "uri-reference": "/c",
    "uri-template": "/c{x}", "json-pointer": "/a", "relative-json-pointer": "0/a",
}


def test_the_allow_list_is_the_keywords_measured_here():
    assert set(ENFORCED) == set(KEYWORD_TYPE)
    assert set(FORMAT_VALUES) == FORMATS


@pytest.mark.parametrize("keyword", ENFORCED)
@pytest.mark.parametrize("strict", [True, False])
def test_an_allowed_keyword_is_enforced_by_xgrammar(keyword, strict):
    schema, good, bad = ENFORCED[keyword]
    check_schema(schema, strict)
    assert not breaks(schema, good) and breaks(schema, bad)
    assert xgrammar_accepts(schema, good, strict) and not xgrammar_accepts(schema, bad, strict)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_an_allowed_format_is_enforced_by_xgrammar(fmt):
    schema = {"type": "string", "format": fmt}
    check_schema(schema, True)
    assert xgrammar_accepts(schema, FORMAT_VALUES[fmt]) and not xgrammar_accepts(schema, "no pe{")


# (keyword the error names, schema, a value that breaks it which xgrammar accepts, strict;
# `checkable`: jsonschema can confirm the value breaks it)
REFUSED = [
    ("not", {"type": "string", "not": {"type": "string"}}, "a", True, True),
    ("uniqueItems", {"type": "array", "items": INT, "uniqueItems": True}, [1, 1], True, True),
    ("contains", {"type": "array", "items": INT, "contains": {"const": 5}, "maxContains": 1}, [1], True, True),
    ("if", {"type": "integer", "if": {"minimum": 3}, "then": {"maximum": 5}}, 7, True, True),
    ("dependentRequired", {"type": "object", "properties": {"a": INT, "b": INT}, "dependentRequired": {"a": ["b"]}},
     {"a": 1}, True, True),
    ("dependentSchemas", {"type": "object", "properties": {"a": INT, "b": INT},
                          "dependentSchemas": {"a": {"required": ["b"]}}}, {"a": 1}, True, True),
    ("contentEncoding", {"type": "string", "contentEncoding": "base64"}, "!!", True, False),
    ("multipleOf", {"type": "number", "multipleOf": 0.5}, 1.25, True, True),
    ("multipleOf", {"type": "integer", "multipleOf": 1.5}, 2, True, True),
    ("multipleOf", {"type": "integer", "multipleOf": 1025}, 5, True, True),  # past xgrammar's 1024: dropped
    ("format", {"type": "string", "format": "regex"}, "(", True, True),
    ("format", {"type": "string", "format": "iri"}, "no pe", True, False),
    ("minimum", {"minimum": 3}, 2, True, True),
    ("minLength", {"minLength": 3}, "a", True, True),
    ("format", {"format": "email"}, "nope", True, True),
    ("maxItems", {"maxItems": 1}, [1, 2], True, True),
    ("maxProperties", {"maxProperties": 1}, {"a": 1, "b": 2}, True, True),
    ("maxLength", {"type": "string", "format": "email", "maxLength": 3}, "abcd@b.co", True, True),
    ("minLength", {"type": "string", "pattern": "a+", "minLength": 3}, "a", True, True),
    ("type", {"type": "integer", "enum": [1, "a"]}, "a", True, True),
    ("minimum", {"type": "integer", "enum": [1, 2], "minimum": 2}, 1, True, True),
    ("type", {"$ref": "#/$defs/x", "type": "string", "$defs": {"x": INT}}, 1, True, True),
    ("minimum", {"anyOf": [INT, {"type": "number"}], "minimum": 5}, 3, True, True),
    ("allOf", {"allOf": [{"type": "object", "properties": {"a": INT}, "required": ["a"]},
                         {"type": "object", "properties": {"b": INT}, "required": ["b"]}]}, {"a": 1}, False, True),
    ("oneOf", {"oneOf": [INT, {"type": "integer", "minimum": 3}]}, 5, True, True),
    ("oneOf", {"oneOf": [{"type": "number"}, INT]}, 5, True, True),
    ("$ref", {"$ref": "#xx", "$defs": {"x": {"$anchor": "xx", "type": "integer"}}}, "a", True, False),
    ("$ref", {"$ref": "http://example.com/x.json"}, "a", True, False),
    ("required", {"type": "object", "properties": {"a": INT}, "required": ["b"]}, {"a": 1}, True, True),
    ("propertyNames", {"type": "object", "properties": {"b": INT}, "propertyNames": {"pattern": "^a.*$"}},
     {"b": 1}, False, True),
    ("patternProperties", {"type": "object", "properties": {"ab": {"type": "string"}},
                           "patternProperties": {"^a.*$": INT}}, {"ab": "x"}, False, True),
    ("unevaluatedProperties", {"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False},
     {"a": 1, "b": 1}, False, True),
    ("not", {"type": "object", "properties": {"a": {"type": "array", "items": {"not": {"const": 1}}}}},
     {"a": [1]}, True, True),
]


@pytest.mark.parametrize("keyword,schema,bad,strict,checkable", REFUSED)
def test_a_schema_xgrammar_would_not_enforce_is_refused_naming_the_keyword(keyword, schema, bad, strict, checkable):
    assert not checkable or breaks(schema, bad)
    assert xgrammar_accepts(schema, bad, strict), "xgrammar enforces this now: allow it"
    with pytest.raises(HyraxInputError, match=f"keyword '{keyword.replace('$', '[$]')}'"):
        check_schema(schema, strict)


@pytest.mark.parametrize("schema", [{"type": "integer", "nullable": True}, {"type": "string", "x-vendor": 1},
                                    {"type": "object", "properties": {"a": {"$dynamicRef": "#x"}}},
                                    {"type": "object", "properties": {"a": {"$id": "http://a/b", "type": "integer"}}}])
def test_keywords_outside_the_lists_are_refused(schema):
    """Nothing is silently ignored: an unknown keyword (OpenAPI's nullable, a vendor extension)
    and a $id below the root (it would move what "#/..." means there) are refused too."""
    with pytest.raises(HyraxInputError, match="not enforced by the grammar engine"):
        check_schema(schema, True)


def test_annotations_are_accepted_and_keys_inside_properties_are_names():
    schema = {"type": "object", "title": "t", "description": "d", "examples": [{"not": 1}], "default": {"not": 1},
              "$comment": "c", "deprecated": False, "readOnly": True, "writeOnly": False, "$id": "urn:x",
              "$schema": "https://json-schema.org/draft/2020-12/schema",
              "properties": {"not": INT, "title": {"type": "string", "enum": ["a"], "description": "d"}},
              "required": ["not", "title"]}
    assert set(ANNOTATIONS) <= set(schema)
    check_schema(schema, True)
    assert xgrammar_accepts(schema, {"not": 1, "title": "a"}) and not xgrammar_accepts(schema, {"not": 1})


def test_grammar_spec_refuses_it_for_a_json_schema_only():
    with pytest.raises(HyraxInputError, match="keyword 'uniqueItems' at properties.a"):
        GrammarSpec.json_schema({"type": "object", "properties": {"a": {"type": "array", "uniqueItems": True}}}).check()
    GrammarSpec("json_object").check()
    GrammarSpec.json_schema({"type": "object", "properties": {"a": INT}, "unevaluatedProperties": False}).check()
    with pytest.raises(HyraxInputError, match="unevaluatedProperties"):
        GrammarSpec.json_schema({"type": "object", "unevaluatedProperties": False}, strict=False).check()
