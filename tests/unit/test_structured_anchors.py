"""A regular expression with an anchor inside it (`a^b`, `a$b`) in a `structured_outputs.regex`,
a JSON schema's `pattern` or `patternProperties` key, or a forced tool's parameters is a 400
naming the pattern. xgrammar drops every anchor and matches the whole text, so `a^b` (which
matches nothing) let the answer be "ab"; the request used to be accepted. Anchors that only
mark the text's start or end (`^a$`, `^a$|^b$`, `(^a|b)c`), escaped ones and those inside a
character class keep their meaning and are accepted."""
from __future__ import annotations

import re

import pytest

from gateway_fakes import Replica, gateway
from hyrax.api.errors import APIError
from hyrax.api.schemas import ChatRequest
from hyrax.api.structured import anchor_inside, grammar_of, misread_inside

INSIDE = [("a^b", 1), ("a$b", 1), ("a?^b", 2), ("(a)^b", 3), ("x(^a|b)", 2), ("(a$|b)c", 2), ("a$?", 1),
          ("[a]^", 3), (r"\^a^", 3), ("(?:a|b)$c", 7)]
AT_THE_EDGES = ["^ab$", "^a$|^b$", "(^a|b)c", "a(b|c$)", r"\^a\$b", "[$^]x", "[^a]b", "(?:^a)b", "^^a$$",
                "[a\\]^]$"]
XGRAMMAR_REFUSES = ["[]^]x", "(?P<n>^a)"]  # it has no leading ']' in a class, nor named groups: its own 400


@pytest.mark.parametrize("pattern,at", INSIDE)
def test_an_anchor_inside_the_pattern_is_found_where_it_is(pattern, at):
    assert anchor_inside(pattern) == at


@pytest.mark.parametrize("pattern", AT_THE_EDGES + XGRAMMAR_REFUSES)
def test_anchors_at_the_edges_escaped_or_in_a_class_are_not_refused(pattern):
    assert anchor_inside(pattern) is None
    if pattern not in XGRAMMAR_REFUSES:
        grammar_of(_chat(structured_outputs={"regex": pattern}))  # and xgrammar compiles it


def test_xgrammar_still_drops_an_anchor_inside_a_pattern():
    """Why the check exists: were xgrammar to enforce `a^b` one day, the check could go."""
    xgr = pytest.importorskip("xgrammar")
    assert str(xgr.Grammar.from_regex("a^b")) == str(xgr.Grammar.from_regex("ab"))
    assert str(xgr.Grammar.from_regex("a$b")) == str(xgr.Grammar.from_regex("ab"))


def _chat(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw})


def _schema(pattern: str) -> dict:
    return {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}}, "required": ["code"]}


REFUSED = [
    ({"structured_outputs": {"regex": "a^b"}}, "structured_outputs", "regex 'a^b' has '^' at character 1"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": _schema("[0-9]+$x")}}},
     "response_format", "'pattern' at properties.code: '[0-9]+$x' has '$' at character 6"),
    ({"structured_outputs": {"json": {"type": "object", "patternProperties": {"^k$|a^": {"type": "integer"}}}}},
     "structured_outputs", "'patternProperties': key '^k$|a^' has '^' at character 5"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": _schema("x$y")}}],
      "tool_choice": "required"}, "tools", "'pattern' at $defs.f.properties.code: 'x$y' has '$' at character 1"),
]


@pytest.mark.parametrize("body,param,says", REFUSED, ids=["regex", "response_format", "patternProperties", "tools"])
def test_a_request_with_an_anchor_inside_a_pattern_is_a_400_naming_it(body, param, says):
    r = gateway(Replica()).post("/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": "hi"}], **body})  # the replica fails the test if the request reaches it
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert says in error["message"] and error["param"] == param and error["code"] == "invalid_value", error


def test_a_schema_pattern_with_anchors_at_its_edges_is_accepted():
    spec = grammar_of(_chat(structured_outputs={"json": _schema("^[a-z]+$|^[0-9]+$")}))
    assert spec is not None
    with pytest.raises(APIError, match=r"'a\^b' has '\^' at character 1"):
        grammar_of(_chat(structured_outputs={"json": {"anyOf": [_schema("^ok$"), _schema("a^b")]}}))


# escapes xgrammar reads as the plain character although they mean something else elsewhere
# (Python/PCRE: \A \Z \z \G anchors, \Q..\E quoting, \K, \R, \h, \N, \X), \0 (xgrammar: nothing at
# all), and POSIX classes inside brackets (xgrammar: a class of the characters '[', ':', 'a', ...)
MISREAD = [(r"\Aab", 0, r"\A"), (r"ab\Z", 2, r"\Z"), (r"ab\z", 2, r"\z"), (r"\Gx", 0, r"\G"), (r"\Qa.b\E", 0, r"\Q"),
           (r"a\Kb", 1, r"\K"), (r"[\h]", 1, r"\h"), (r"a\0", 1, r"\0"), ("[[:alpha:]]+", 1, "[:alpha:]"),
           (r"x[^[:digit:]a]", 3, "[:digit:]")]
READ_AS_MEANT = [r"\d\D\w\W\s\S", r"\t\n\r\f\v", r"\x41\u0042", r"\cA", r"\a\e", r"\.\*\+\?\(\)\[\]\{\}\|\\\/\-",
                 r"[\d\s.-]", "[[]:]", "[:a]", r"\[:alpha:]"]


@pytest.mark.parametrize("pattern,at,what", MISREAD)
def test_an_escape_or_class_the_grammar_engine_misreads_is_found(pattern, at, what):
    assert misread_inside(pattern) == (at, what)


@pytest.mark.parametrize("pattern", READ_AS_MEANT)
def test_escapes_and_classes_read_as_meant_are_not_refused(pattern):
    assert misread_inside(pattern) is None
    grammar_of(_chat(structured_outputs={"regex": pattern}))  # and xgrammar compiles it


def test_a_request_with_a_misread_escape_is_a_400_naming_it():
    r = gateway(Replica()).post("/v1/chat/completions", json={"model": "m", "messages": [
        {"role": "user", "content": "hi"}], "structured_outputs": {"json": _schema(r"\A[a-z]+\Z")}})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert r"'\A[a-z]+\Z' has '\A' at character 0" in error["message"], error
    assert error["param"] == "structured_outputs" and error["code"] == "invalid_value", error


@pytest.mark.parametrize("pattern,what", [(r"\d\Z", r"\Z"), (r"\w+a^b", "^"), (r"[\d]\.x$y", "$")])
def test_the_400_shows_the_pattern_as_sent_so_its_position_counts_in_what_it_shows(pattern, what):
    """The message quotes the pattern as the client wrote it: a repr doubled each backslash, so
    `\\d\\Z` showed as '\\\\d\\\\Z' and "at character 2" pointed at a 'd' of what it showed."""
    with pytest.raises(APIError) as e:
        grammar_of(_chat(structured_outputs={"regex": pattern}))
    shown = re.search(r"the regex '(.*)' has '(.*)' at character (\d+)", e.value.message)
    assert shown is not None, e.value.message
    assert shown[1] == pattern and shown[2] == what and pattern[int(shown[3]):].startswith(what), e.value.message


@pytest.mark.parametrize("pattern,says", [("(?i)^abc$", "Group modifier flag"), ("(?m)^a$", "Group modifier flag"),
                                          ("(?=a)^b", "Lookahead"), (r"\b^a", "Word boundary")])
def test_a_pattern_the_grammar_engine_refuses_is_refused_for_its_own_reason_not_for_its_anchor(pattern, says):
    """`(?i)^abc$` has its '^' where nothing comes before it, and xgrammar refuses the flag group
    itself: the 400 names the flag group, not an anchor "inside the pattern" that is not there
    (which sent a client to drop a correct '^' and then meet the flag's error)."""
    with pytest.raises(APIError) as e:
        grammar_of(_chat(structured_outputs={"regex": pattern}))
    assert says in e.value.message and "inside the pattern" not in e.value.message, e.value.message
