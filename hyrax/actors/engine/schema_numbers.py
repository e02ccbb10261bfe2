"""Numbers in a JSON schema that the grammar engine cannot read, refused in our words before it
sees them. JSON has no bound on a number, Python reads `1e400` as infinity (which its JSON
writer spells `Infinity`, no JSON at all) and an integer of 400 digits as itself; xgrammar reads
numbers as doubles and integer bounds as int64, and refused the rest with its own internals
("Check failed: (error.empty()) is false: Failed to parse JSON ... Infinity")."""
from __future__ import annotations

import math

INT64 = (-2**63, 2**63 - 1)
INTEGER_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _fits_a_double(v) -> bool:
    try:
        return math.isfinite(float(v))
    except OverflowError:  # an int beyond a double's range
        return False


def _integer_typed(node: dict) -> bool:
    t = node.get("type")
    return t == "integer" or (isinstance(t, list) and "integer" in t)


def out_of_range(schema) -> str | None:
    """Why a number in `schema` is out of the range the grammar engine reads, saying where; None
    when every number is in range. Iterative: a schema may be nested as deeply as the parser
    allows."""
    todo = [("", schema, False)]  # (where, value, whether it is an integer-typed schema's bound)
    while todo:
        path, v, bound = todo.pop()
        where = f" at {path}" if path else ""
        if isinstance(v, dict):
            integer = _integer_typed(v)
            todo.extend((f"{path}.{k}" if path else str(k), x, integer and k in INTEGER_BOUNDS) for k, x in v.items())
        elif isinstance(v, list):
            todo.extend((f"{path}.{i}" if path else str(i), x, False) for i, x in enumerate(v))
        elif _number(v) and not _fits_a_double(v):
            return f"a number{where} is out of range: the grammar engine reads numbers as doubles (up to ±1.8e308)"
        elif bound and _number(v) and not INT64[0] <= v <= INT64[1]:
            return (f"{v}{where} is out of range: the grammar engine takes an integer's bounds from -2^63 to "
                    "2^63 - 1")
    return None
