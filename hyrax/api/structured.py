"""Structured output requested over the API: OpenAI's `response_format` and vLLM's
`structured_outputs` extras (json, regex, choice), as the engine's `GrammarSpec`."""
from __future__ import annotations

import asyncio
import json

from hyrax.actors.engine.grammar import GrammarKind, GrammarSpec
from hyrax.actors.engine.schema_keywords import _SUBSCHEMA, _SUBSCHEMA_LISTS, _SUBSCHEMA_MAPS
from hyrax.actors.model.errors import HyraxInputError
from hyrax.api.errors import APIError
from hyrax.api.json_body import parse
from hyrax.api.schemas import _Sampling, lone_surrogate


async def checked_grammar(body: _Sampling) -> GrammarSpec | None:
    """`grammar_of`, run off the event loop when there is a grammar: its check compiles it, which
    takes seconds for a schema of thousands of properties, and other clients must not wait."""
    rf = body.response_format
    if (rf is None or rf.type == "text") and body.structured_outputs is None:
        return grammar_of(body)
    return await asyncio.to_thread(grammar_of, body)


def grammar_of(body: _Sampling) -> GrammarSpec | None:
    """The grammar the answer must match (None: free text); a bad one is a 400 naming its field."""
    rf, so = body.response_format, body.structured_outputs
    spec, param = None, None
    if rf is not None and rf.type != "text":
        param = "response_format"
        if rf.type == "json_object":
            spec = GrammarSpec(GrammarKind.JSON_OBJECT)
        else:
            spec = GrammarSpec.json_schema(rf.json_schema.schema_, strict=bool(rf.json_schema.strict))
    if so is not None:
        if spec is not None:
            raise APIError(400, "give response_format or structured_outputs, not both", param="structured_outputs",
                           code="invalid_value")
        param = "structured_outputs"
        if so.json_ is not None:
            schema = so.json_
            if isinstance(schema, str):
                schema = _schema_text(schema)
            if not isinstance(schema, dict):
                raise APIError(400, "structured_outputs.json must be a JSON schema object", param=param,
                               code="invalid_value")
            where = lone_surrogate(schema)  # \ud800 escapes in the JSON text
            if where is not None:
                raise APIError(400, f"structured_outputs.json: invalid text: lone surrogate {where}",
                               param="structured_outputs.json", code="invalid_value")
            spec = GrammarSpec.json_schema(schema)
        elif so.regex is not None:
            spec = GrammarSpec(GrammarKind.REGEX, so.regex)
        else:
            spec = GrammarSpec.choice(so.choice)
    if spec is not None:
        check(spec, param)
    return spec


def _schema_text(text: str):
    """The JSON value of a schema given as text, read as a request body is (json_body.parse): a
    key twice in one object, nesting deeper than the parser goes or a number too long is a 400."""
    try:
        return parse(text.encode("utf-8"))
    except APIError as e:
        why = e.message.partition(": ")[2] or e.message  # "request body is not valid JSON: <why>"
        raise APIError(400, f"structured_outputs.json is not valid JSON: {why}", param="structured_outputs",
                       code="invalid_value") from None


def check(spec: GrammarSpec, param: str) -> None:
    """A 400 naming `param` for a grammar the engine would not enforce as written. What the
    grammar engine refuses itself goes first: `(?i)^a$` is refused for its flag group, which
    xgrammar does not implement, not for a '^' that only looks as if something came before it."""
    try:
        spec.check()
    except HyraxInputError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None
    for where, pattern in _patterns(spec):
        at = anchor_inside(pattern)
        if at is not None:
            raise APIError(400, f"{where} {_quoted(pattern)} has '{pattern[at]}' at character {at}, inside the "
                                "pattern, which the grammar engine ignores (it would accept strings the pattern "
                                "refuses): '^' is allowed only where nothing comes before it and '$' only where "
                                "nothing comes after it (write \\^ or \\$ for the characters)",
                           param=param, code="invalid_value")
        bad = misread_inside(pattern)
        if bad is not None:
            at, what = bad
            raise APIError(400, f"{where} {_quoted(pattern)} has {_quoted(what)} at character {at}, which the grammar "
                                f"engine would not read as it is meant ({_misread_why(what)})",
                           param=param, code="invalid_value")


def _quoted(text: str) -> str:
    """`text` in quotes as the client wrote it, so that a position counts in what is shown (a
    repr would double each backslash). Only a character that does not print is escaped (a
    newline shows as \\n), which the positions after it then do not count."""
    return "'" + "".join(c if c.isprintable() else ascii(c)[1:-1] for c in text) + "'"


def _patterns(spec: GrammarSpec) -> list[tuple[str, str]]:
    """(where, pattern) of each regular expression in `spec`: a regex, or a JSON schema's
    `pattern`s and `patternProperties` keys (iterative: a schema may be nested deeply)."""
    if spec.kind == GrammarKind.REGEX:
        return [("the regex", spec.source)]
    if spec.kind != GrammarKind.JSON_SCHEMA:
        return []
    found, todo = [], [("", json.loads(spec.source))]
    while todo:
        path, node = todo.pop()
        if not isinstance(node, dict):
            continue
        at = f" at {path}" if path else ""
        if isinstance(node.get("pattern"), str):
            found.append((f"JSON-schema keyword 'pattern'{at}:", node["pattern"]))
        todo.extend((_join(path, k), node[k]) for k in _SUBSCHEMA if k in node)
        for k in _SUBSCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                found += [(f"JSON-schema keyword 'patternProperties'{at}: key", p) for p in node[k]
                          if k == "patternProperties"]
                todo.extend((_join(path, k, name), sub) for name, sub in node[k].items())
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                todo.extend((_join(path, k, str(i)), sub) for i, sub in enumerate(node[k]))
    return found


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def anchor_inside(pattern: str) -> int | None:
    """Where `pattern` has an anchor xgrammar ignores although it changes what matches: a '^'
    that something may come before, or a '$' that something may come after. xgrammar matches
    the whole text and drops every anchor, so the ones that only say "the start" or "the end"
    (`^a$`, `^a$|^b$`, `(^a|b)c`) keep their meaning, and `a^b` (matching nothing) would match
    "ab". Escaped anchors and those inside a character class are characters. None: no such
    anchor."""
    tokens = _regex_tokens(pattern)
    for opening, closing, anchor, order in (("(", ")", "^", tokens), (")", "(", "$", tokens[::-1])):
        edge, groups = True, []  # edge: nothing can come between here and the text's edge
        for i, kind in order:
            if kind == opening:
                groups.append(edge)
            elif kind == closing:
                if groups:
                    groups.pop()
                edge = False
            elif kind == "|":
                edge = groups[-1] if groups else True
            elif kind == anchor:
                if not edge:
                    return i
            elif kind not in "^$":
                edge = False  # a character, a class or a quantifier
    return None


# escapes xgrammar reads as meant: classes, control characters, code points (\b \B \p \P \k and
# back-references it refuses itself); any other escaped letter it reads as the letter
_ESCAPES_MEANT = frozenset("dDwWsStnrfvxucaebBpPk")


def _misread_why(what: str) -> str:
    """How xgrammar reads `what` (an escape or a POSIX class `misread_inside` found)."""
    if what == "\\0":
        return "it reads \\0 as nothing at all"
    if what.startswith("\\"):
        anchor = ", not as an anchor: write ^ or $ at the edge" if what[1] in "AZzG" else ""
        return f"it reads {what} as the letter {what[1]}{anchor}"
    return "it reads a POSIX class as its characters '[', ':', ...: write the characters, e.g. [a-zA-Z] for [:alpha:]"


def misread_inside(pattern: str) -> tuple[int, str] | None:
    """(position, text) of the first escape or POSIX class in `pattern` that xgrammar reads
    other than the pattern means: an escaped letter that is not one of its escapes (`\\A`,
    `\\Z`: anchors elsewhere, the letters there), `\\0` (a NUL elsewhere, nothing there), or
    `[:alpha:]` inside a bracket. None: there is none."""
    i, depth = 0, 0  # depth: inside a character class
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            nxt = pattern[i + 1:i + 2]
            if nxt == "0" or (nxt.isascii() and nxt.isalpha() and nxt not in _ESCAPES_MEANT):
                return i, pattern[i:i + 2]
            i += 2
            continue
        if depth and ch == "[" and pattern.startswith(":", i + 1):
            end = pattern.find(":]", i + 2)
            if end > i + 2 and pattern[i + 2:end].isalpha():
                return i, pattern[i:end + 2]
        if ch == "[" and not depth:
            depth, i = 1, i + 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):  # a leading ] is a member
                i += 1
            continue
        if ch == "]" and depth:
            depth = 0
        i += 1
    return None


def _regex_tokens(pattern: str) -> list[tuple[int, str]]:
    """(position, kind) of each token of `pattern`: kind '(' (any group's opening, its `?:`,
    `?P<name>`, lookaround marks included), ')', '|', '^', '$', or 'x' (a character, an escape, a
    character class, a quantifier)."""
    out, i = [], 0
    while i < len(pattern):
        ch, start = pattern[i], i
        if ch == "\\":
            i += 2
        elif ch == "[":
            i += 1
            if pattern.startswith("^", i):
                i += 1
            if pattern.startswith("]", i):  # a leading ] is a member
                i += 1
            while i < len(pattern) and pattern[i] != "]":
                i += 2 if pattern[i] == "\\" else 1
            i += 1
        elif ch == "(":
            i += 1
            if pattern.startswith(("?<=", "?<!"), i):
                i += 3
            elif pattern.startswith(("?P<", "?<"), i):  # a named group: up to the name's end
                i = pattern.find(">", i) + 1 or len(pattern)
            elif pattern.startswith("?", i):  # ?: ?= ?! (flags, which xgrammar refuses, too)
                i += 2
            out.append((start, "("))
            continue
        else:
            i += 1
        out.append((start, ch if ch in ")|^$" else "x"))
    return out
