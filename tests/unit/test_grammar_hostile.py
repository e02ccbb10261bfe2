"""Grammars an unlucky or hostile client sends: each is refused by the check the gateway and the
engine both run (`GrammarSpec.check`), or constrains the answer as asked. Before, some passed
the check and then failed rank 0's compile (failing the whole step, and every request batched
with it), some compiled with the keyword silently dropped, and a choice outside the Basic
Multilingual Plane could never be written."""
from __future__ import annotations

import json

import pytest

from hyrax.actors.engine.grammar import GrammarKind, GrammarSpec
from hyrax.actors.model.errors import HyraxInputError

xgr = pytest.importorskip("xgrammar")


def _matches(spec: GrammarSpec, text: str) -> bool:
    """Whether a matcher of the spec (compiled as rank 0 does, any vocabulary) takes `text` whole."""
    compiled = xgr.GrammarCompiler(xgr.TokenizerInfo([]), cache_enabled=False).compile_grammar(spec._grammar())
    m = xgr.GrammarMatcher(compiled, terminate_without_stop_token=True)
    return m.accept_string(text) and m.is_terminated()


@pytest.mark.parametrize("schema,needle", [
    ({"type": "string", "minLength": -1}, "'minLength'"),  # passed the check, then failed rank 0's compile
    ({"type": "string", "maxLength": -1}, "'maxLength'"),  # xgrammar read -1 as "no bound"
    ({"type": "array", "items": {"type": "integer"}, "minItems": -1}, "'minItems'"),
    ({"type": "object", "properties": {"a": {"type": "string", "minLength": -3}}}, "'minLength' at properties.a"),
])
def test_a_negative_size_bound_is_refused_naming_it(schema, needle):
    with pytest.raises(HyraxInputError, match=needle):
        GrammarSpec.json_schema(schema).check()


def test_the_check_compiles_the_grammar_as_rank_0_does(monkeypatch):
    """Beyond the keyword rules, the check compiles the grammar (with an empty vocabulary), so a
    schema xgrammar parses but cannot compile is a 400, never a failed step on rank 0."""
    import hyrax.actors.engine.grammar as grammar

    monkeypatch.setattr(grammar, "check_schema", lambda schema, strict: None)  # a gap in the keyword rules
    with pytest.raises(HyraxInputError, match="invalid json_schema"):
        GrammarSpec.json_schema({"type": "string", "minLength": -1, "title": "compile-only"}).check()


@pytest.mark.parametrize("schema,needle", [
    ({"type": []}, "'type'"),  # xgrammar accepted any value
    ({"anyOf": []}, "'anyOf'"),  # no value matches: the answer was empty, "stop"
    ({"oneOf": []}, "'oneOf'"),
    ({"type": "object", "properties": {"a": {"anyOf": []}}, "required": ["a"]}, "'anyOf' at properties.a"),
])
def test_a_schema_no_value_or_any_value_matches_by_mistake_is_refused(schema, needle):
    with pytest.raises(HyraxInputError, match=needle):
        GrammarSpec.json_schema(schema).check()


@pytest.mark.parametrize("pattern", ["^(?=a)[a-z]+$", "^(?!a)[a-z]+$", "x(?=y)", "[(]?(?!b)c"])
def test_a_lookahead_in_a_schema_pattern_is_refused(pattern):
    """xgrammar drops a lookahead inside a JSON schema's pattern (it logs a warning) and the answer
    may break it; a bare regex with one is already refused by xgrammar itself."""
    spec = GrammarSpec.json_schema({"type": "string", "pattern": pattern})
    with pytest.raises(HyraxInputError, match="lookahead"):
        spec.check()
    with pytest.raises(HyraxInputError):
        GrammarSpec(GrammarKind.REGEX, pattern).check()


@pytest.mark.parametrize("pattern", ["^[(?=]+$", r"^\(\?=a$", "^a(b|c)?$"])
def test_a_pattern_that_only_looks_like_a_lookahead_is_accepted(pattern):
    GrammarSpec.json_schema({"type": "string", "pattern": pattern}).check()


@pytest.mark.parametrize("options", [["😀", "😂"], ["a😀b", "é", "東京"], ['q"u\\o\nte', "\U0010ffff"]])
def test_choice_options_outside_the_bmp_are_written_as_given(options):
    """An option was written into the grammar as JSON's \\ud83d\\ude00 escape pair, which the
    grammar read as two lone surrogates: the answer was never one of the options."""
    spec = GrammarSpec.choice(options)
    spec.check()
    for o in options:
        assert _matches(spec, o), o
    assert not _matches(spec, options[0] + "x")


@pytest.mark.parametrize("required", [[["a"]], [{"a": 1}], ["a", None], [1]])
def test_required_listing_what_is_no_property_name_is_refused(required):
    """Before, a list or an object in `required` raised TypeError in the check (a 500)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": required}
    with pytest.raises(HyraxInputError, match="'required'"):
        GrammarSpec.json_schema(schema).check()
