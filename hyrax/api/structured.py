"""Structured output requested over the API: OpenAI's `response_format` and vLLM's
`structured_outputs` extras (json, regex, choice), as the engine's `GrammarSpec`."""
from __future__ import annotations

import asyncio

from hyrax.actors.engine.grammar import GrammarKind, GrammarSpec
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
    try:
        spec.check()
    except HyraxInputError as e:
        raise APIError(400, str(e), param=param, code="invalid_value") from None
