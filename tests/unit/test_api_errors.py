"""Every error the gateway raises names a `code` that docs/api.md documents: APIError cannot be
built without one, and every code written in hyrax/api/ appears in the docs' error table."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

from hyrax.api.errors import APIError

ROOT = Path(__file__).resolve().parents[2]


def _codes_in(tree) -> list[tuple[int, object]]:
    """(line, code) for every APIError(...) / error_response(...) call; code None when missing."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) in ("APIError", "error_response"):
            kw = {k.arg: k.value for k in node.keywords}
            out.append((node.lineno, kw.get("code")))
    return out


def _literals(node) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, ast.IfExp):
        return _literals(node.body) + _literals(node.orelse)
    return []  # computed (e.g. an Outcome's value): checked by the e2e tests


def test_an_api_error_without_a_code_cannot_be_built():
    with pytest.raises(TypeError):
        APIError(400, "no code")
    assert APIError(400, "x", code="invalid_value").code == "invalid_value"


def test_every_error_raised_in_the_api_names_a_documented_code():
    docs = (ROOT / "docs" / "api.md").read_text()
    calls = 0
    for path in sorted((ROOT / "hyrax" / "api").glob("*.py")):
        for line, code in _codes_in(ast.parse(path.read_text())):
            calls += 1
            assert code is not None, f"{path.name}:{line}: an error without a code"
            for c in _literals(code):
                assert f"`{c}`" in docs, f"{path.name}:{line}: code {c!r} is not in docs/api.md"
    assert calls > 40
