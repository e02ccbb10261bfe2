"""The JSON-Schema keywords the grammar engine enforces, and the check that a schema asks for
nothing else (docs/api.md, "Structured output").

xgrammar compiles a schema with a keyword it does not implement by dropping the keyword, and
the answer may then break the schema (`"not"`, `"uniqueItems"`, a `"minimum"` without a
`"type"`, ...). Hyrax refuses such a schema instead: `check_schema` raises HyraxInputError
naming the keyword and where it is.

Found with xgrammar 0.2.9 by compiling small schemas and asking its matcher whether a JSON
text that breaks the keyword is accepted; tests/unit/test_schema_keywords.py repeats that for
every keyword and rule here, so an upgrade that changes them is noticed.
"""
from __future__ import annotations

from hyrax.actors.model.errors import HyraxInputError

# Keywords that constrain nothing: accepted, with no effect on the answer.
ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$comment", "deprecated", "readOnly",
                         "writeOnly", "$schema"})
# Enforced keywords, by the JSON type they constrain (None: a value of any type).
ENFORCED = {
    None: ("type", "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "$defs", "definitions"),
    "number": ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum", "multipleOf"),
    "string": ("minLength", "maxLength", "pattern", "format"),
    "array": ("items", "prefixItems", "unevaluatedItems", "minItems", "maxItems"),
    "object": ("properties", "required", "additionalProperties", "unevaluatedProperties", "patternProperties",
               "propertyNames", "minProperties", "maxProperties"),
}
KEYWORD_TYPE = {k: t for t, ks in ENFORCED.items() for k in ks}
MAX_MULTIPLE_OF = 1024  # the largest integer multipleOf xgrammar applies
# Type-specific keywords xgrammar applies in a schema without "type" (it infers the type from
# them); it drops the others there.
INFERS_TYPE = frozenset({"items", "prefixItems", "unevaluatedItems", "properties", "required", "additionalProperties"})
# "format" values xgrammar enforces (it drops the others: regex, iri, idn-email, ...).
FORMATS = frozenset({"date", "time", "date-time", "duration", "email", "hostname", "ipv4", "ipv6", "uuid", "uri",
                     "uri-reference", "uri-template", "json-pointer", "relative-json-pointer"})
# Keywords xgrammar applies alone: it drops every other constraint in the same schema.
ALONE = ("$ref", "enum", "const", "anyOf", "oneOf", "allOf")
NOT_CONSTRAINTS = ANNOTATIONS | {"$defs", "definitions", "$id"}
STRING_GROUPS = (("pattern",), ("format",), ("minLength", "maxLength"))  # xgrammar applies one group
# Size bounds: xgrammar reads a negative maxLength as "no bound", and a negative minLength passes its
# parse and then fails the compile against the tokenizer; JSON Schema wants non-negative integers.
SIZES = ("minLength", "maxLength", "minItems", "maxItems", "minProperties", "maxProperties")

_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "unevaluatedItems", "propertyNames")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def check_schema(schema, strict: bool) -> None:
    """Raise HyraxInputError when `schema` uses a keyword, or a combination, that xgrammar would
    not enforce. `strict`: no properties the schema does not name (xgrammar's strict mode).
    Iterative: a schema may be nested as deeply as the JSON parser allows. Values of an odd
    shape are left to xgrammar's compile, which reports them."""
    todo = [("", schema)]
    while todo:
        path, node = todo.pop()
        if not isinstance(node, dict):
            continue
        _check_node(path, node, strict)
        for k in _SUBSCHEMA:
            if k in node:
                sub = node[k]
                if k == "propertyNames" and isinstance(sub, dict) and "type" not in sub:
                    sub = {**sub, "type": "string"}  # names are strings: xgrammar applies string keywords there
                todo.append((_join(path, k), sub))
        for k in _SUBSCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                todo.extend((_join(path, k, name), sub) for name, sub in node[k].items())
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                todo.extend((_join(path, k, str(i)), sub) for i, sub in enumerate(node[k]))


def _join(*parts: str) -> str:
    return ".".join(p for p in parts if p)


def _refuse(path: str, keyword: str, why: str) -> HyraxInputError:
    return HyraxInputError(f"JSON-schema keyword {keyword!r}{' at ' + path if path else ''}: {why}")


def _check_node(path: str, node: dict, strict: bool) -> None:
    for k in node:
        if k not in KEYWORD_TYPE and k not in ANNOTATIONS and not (k == "$id" and not path):
            raise _refuse(path, k, "not enforced by the grammar engine, which would ignore it, so the answer could "
                                   "break it (docs/api.md lists the keywords it enforces)")
    _check_values(path, node)
    types = _types(node)
    alone = [k for k in ALONE if k in node]
    if alone:
        _check_alone(path, node, alone[0], types)
    for k in node:
        kind = KEYWORD_TYPE.get(k)
        if kind is not None and types is None and k not in INFERS_TYPE:
            raise _refuse(path, k, f"the grammar engine applies it only beside \"type\": \"{kind}\" (give the type)")
    if types is None:
        types = set()
    if "multipleOf" in node and types & {"number", "integer"}:
        m = node["multipleOf"]
        if "number" in types or not (isinstance(m, (int, float)) and not isinstance(m, bool) and float(m).is_integer()):
            raise _refuse(path, "multipleOf", "the grammar engine enforces it only for \"type\": \"integer\" and a "
                                              "whole multiple")
        if m > MAX_MULTIPLE_OF:  # xgrammar logs a warning and drops it (zero and below: its own error)
            raise _refuse(path, "multipleOf", f"the grammar engine enforces a multiple of at most {MAX_MULTIPLE_OF}")
    if "string" in types:
        given = [next(k for k in g if k in node) for g in STRING_GROUPS if any(k in node for k in g)]
        if len(given) > 1:
            raise _refuse(path, given[1], f"beside {given[0]!r}: the grammar engine applies one of pattern, format "
                                          "and the length bounds to a string and ignores the others")
        if "format" in node and node["format"] not in FORMATS:
            raise _refuse(path, "format", f"{node['format']!r} is not enforced by the grammar engine (it enforces "
                                          f"{', '.join(sorted(FORMATS))})")
    _check_object(path, node, strict)


def _check_values(path: str, node: dict) -> None:
    """Values xgrammar parses without complaint and then ignores or misreads."""
    for k in SIZES:
        v = node.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and v < 0:
            raise _refuse(path, k, f"{v} is negative; a size bound is a non-negative integer")
    if node.get("type") == []:
        raise _refuse(path, "type", "an empty list of types, which the grammar engine reads as any type")
    for k in ("anyOf", "oneOf"):
        if node.get(k) == []:
            raise _refuse(path, k, "an empty list: no value matches it (give at least one schema)")
    patterns = [("pattern", node["pattern"])] if isinstance(node.get("pattern"), str) else []
    if isinstance(node.get("patternProperties"), dict):
        patterns += [("patternProperties", p) for p in node["patternProperties"]]
    for k, p in patterns:
        at = lookahead_at(p)
        if at is not None:
            raise _refuse(path, k, f"{p!r} has a lookahead at character {at}, which the grammar engine ignores in a "
                                   "schema (it would accept strings the pattern refuses)")


def lookahead_at(pattern: str) -> int | None:
    """Where `pattern` has a lookahead, `(?=` or `(?!`, outside a character class and not
    escaped; None if nowhere."""
    i, in_class = 0, False
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\":
            i += 2
            continue
        if in_class:
            in_class = ch != "]"
        elif ch == "[":
            in_class = True
            if pattern.startswith("]", i + 1) or pattern.startswith("^]", i + 1):  # a leading ] is a member
                i += 2 if pattern[i + 1] == "]" else 3
                continue
        elif pattern.startswith(("(?=", "(?!"), i):
            return i
        i += 1
    return None


def _check_object(path: str, node: dict, strict: bool) -> None:
    props = node.get("properties")
    names = set(props) if isinstance(props, dict) else set()
    required = node.get("required")
    if isinstance(required, list):
        odd = [r for r in required if not isinstance(r, str)]
        if odd:
            raise _refuse(path, "required", f"lists {odd[0]!r}; it lists property names (strings)")
        missing = [r for r in required if r not in names]
        if missing:
            raise _refuse(path, "required", f"names {missing[0]!r}, which \"properties\" does not define; the grammar "
                                            "engine ignores such a name")
    for k in ("propertyNames", "patternProperties"):
        if k in node and props is not None:
            raise _refuse(path, k, "beside \"properties\": the grammar engine does not apply it to the named "
                                   "properties")
    if node.get("unevaluatedProperties") is False and not strict:
        raise _refuse(path, "unevaluatedProperties", "false is not enforced by the grammar engine without strict "
                                                     "mode; use \"additionalProperties\": false")


def _types(node: dict) -> set[str] | None:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list) and all(isinstance(x, str) for x in t):
        return set(t)
    return None


def _check_alone(path: str, node: dict, keyword: str, types: set[str] | None) -> None:
    values = _values(node)
    for k in node:
        if k == keyword or k in NOT_CONSTRAINTS:
            continue
        if k == "type" and values is not None and types is not None and all(_fits(v, types) for v in values):
            continue  # every listed value has the type: it constrains nothing more
        raise _refuse(path, k, f"beside {keyword!r}: the grammar engine applies {keyword!r} alone and would ignore "
                               f"it" + (" (put it inside each branch)" if keyword.endswith("Of") else ""))
    if keyword == "$ref":
        ref = node["$ref"]
        if not (isinstance(ref, str) and (ref == "#" or ref.startswith("#/"))):
            raise _refuse(path, "$ref", "only references within the schema (\"#\", \"#/...\") are followed by the "
                                        "grammar engine; it would accept any value for this one")
    elif keyword == "allOf" and isinstance(node["allOf"], list) and len(node["allOf"]) != 1:
        raise _refuse(path, "allOf", "the grammar engine enforces allOf of one schema only (merge them into one)")
    elif keyword == "oneOf" and isinstance(node["oneOf"], list):
        _check_exclusive(path, node["oneOf"])


def _values(node: dict) -> list | None:
    """The values a schema lists (const, enum), or None."""
    if "const" in node:
        return [node["const"]]
    enum = node.get("enum")
    return enum if isinstance(enum, list) else None


def _fits(value, types: set[str]) -> bool:
    """Whether a JSON value has one of the JSON-Schema types."""
    kind = {bool: "boolean", str: "string", type(None): "null", list: "array", dict: "object"}.get(type(value))
    if kind is not None:
        return kind in types
    if isinstance(value, int) or (isinstance(value, float) and value.is_integer()):
        return bool(types & {"integer", "number"})
    return isinstance(value, float) and "number" in types


def _check_exclusive(path: str, branches: list) -> None:
    """xgrammar enforces oneOf as anyOf: only branches that no value can match twice keep it
    exact. Accepted: every branch lists its values (const, enum) or names its types, and no
    two overlap."""
    seen: list[tuple[list | None, set[str]]] = []
    for b in branches:
        node = b if isinstance(b, dict) else {}
        values, types = _values(node), _types(node)
        if values is None and types is None:
            raise _refuse(path, "oneOf", "the grammar engine enforces it as anyOf; accepted only when each branch "
                                         "names its \"type\" or lists its values (const, enum) and no two overlap: "
                                         "use anyOf")
        for other_values, other_types in seen:
            if _overlap(values, types or set(), other_values, other_types):
                raise _refuse(path, "oneOf", "two branches can match one value, and the grammar engine enforces "
                                             "oneOf as anyOf: use anyOf, or branches of different types or values")
        seen.append((values, types or set()))


def _overlap(values_a: list | None, types_a: set[str], values_b: list | None, types_b: set[str]) -> bool:
    if values_a is not None and values_b is not None:
        return any(_same(x, y) for x in values_a for y in values_b)
    if values_a is not None or values_b is not None:
        values, types = (values_a, types_b) if values_a is not None else (values_b, types_a)
        return any(_fits(v, types) for v in values)
    numbers = {"integer", "number"}
    return bool(types_a & types_b) or ("number" in types_a and types_b & numbers) or (
        "number" in types_b and types_a & numbers)


def _same(x, y) -> bool:
    """JSON equality: true is not 1, 1 is 1.0."""
    return (isinstance(x, bool) == isinstance(y, bool)) and x == y


def moved_under(schema, pointer: str):
    """A copy of `schema` to be placed at the JSON pointer `pointer` ("#/$defs/x") of another
    schema: its references within itself ("#", "#/...") follow it there, and its root `$id` (an
    annotation only at a root) is dropped. Values that are data (const, enum, default, ...) are
    kept as they are. Iterative, as `check_schema`."""
    top = [schema]
    todo = [(top, 0, True)]  # (container, key, at the root)
    while todo:
        parent, key, root = todo.pop()
        node = parent[key]
        if not isinstance(node, dict):
            continue
        node = parent[key] = {k: v for k, v in node.items() if not (root and k == "$id")}
        ref = node.get("$ref")
        if isinstance(ref, str) and (ref == "#" or ref.startswith("#/")):
            node["$ref"] = pointer + ref[1:]
        todo.extend((node, k, False) for k in _SUBSCHEMA if k in node)
        for k in _SUBSCHEMA_MAPS:
            if isinstance(node.get(k), dict):
                node[k] = dict(node[k])
                todo.extend((node[k], name, False) for name in node[k])
        for k in _SUBSCHEMA_LISTS:
            if isinstance(node.get(k), list):
                node[k] = list(node[k])
                todo.extend((node[k], i, False) for i in range(len(node[k])))
    return top[0]
