"""Tool calls: what `tools` + `tool_choice` make of a chat request (the tools the chat template
renders, the grammar the answer must match, the syntax its calls are read back in); the
answer becomes OpenAI's `tool_calls` in `tool_parser.py`.

- `none` (the default without tools): a text answer, not read back as calls; the template still
  renders the tools given (as OpenAI's API and vLLM by default: the model sees them, calls none).
- `required`: the answer is `{"name": <one of the tools>, "arguments": <its parameters>}`,
  constrained to the tools' JSON schemas; it becomes one call.
- a named function: the answer is that function's arguments, constrained to its schema.
- `auto` (the default with tools): free text, in which the model may write calls in its
  template's own syntax; Hyrax reads them back (`tool_parser.py`). That needs a template that
  renders the tools and names a call syntax Hyrax knows (`TOOL_FORMATS`: Hermes-style
  `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the syntax of Hermes- and
  Qwen-style templates, and Nemotron-style `<TOOLCALL>[{...}, ...]</TOOLCALL>`), and a
  tokenizer whose decoding keeps the tags; otherwise `auto` is a 400 that says which of these
  is missing.
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass

from hyrax.actors.engine.grammar import GrammarSpec
from hyrax.actors.engine.schema_keywords import ALONE, moved_under
from hyrax.api.errors import APIError
from hyrax.api.schemas import ChatRequest
from hyrax.api.structured import check
from hyrax.api.text import DEFAULT_CHAT_TEMPLATE
from hyrax.api.tool_parser import ToolCallParser

ANY_OBJECT = {"type": "object"}
# Keywords from which the grammar engine reads an object when "type" is not given.
OBJECT_KEYWORDS = frozenset({"properties", "required", "additionalProperties"})


@dataclass(frozen=True)
class ToolFormat:
    """A template's tool-call syntax: each call is a JSON body {"name", "arguments"} between tags
    (`listed`: each tagged block is a JSON array of them). `unless`: text that marks a look-alike
    syntax with another body between the same tags."""

    name: str
    start: str
    end: str
    listed: bool = False
    unless: tuple[str, ...] = ()

    def written_by(self, source: str) -> bool:
        return self.start in source and self.end in source and not any(u in source for u in self.unless)


# Known call syntaxes, recognised by their tags appearing in the template's source: Hermes and
# Qwen templates write <tool_call>{...}</tool_call>, Nemotron-H (Nano v2) ones
# <TOOLCALL>[{...}, ...]</TOOLCALL>. Qwen3-Coder's templates put XML (<function=name><parameter=
# key>) between <tool_call> tags: not the Hermes syntax.
TOOL_FORMATS = (ToolFormat("hermes", "<tool_call>", "</tool_call>", unless=("<function=",)),
                ToolFormat("nemotron", "<TOOLCALL>", "</TOOLCALL>", listed=True))


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None = None  # what the chat template renders
    grammar: GrammarSpec | None = None  # a forced call: the answer is constrained to it
    name: str | None = None  # a named function: the answer is its arguments
    required: bool = False  # the answer is {"name", "arguments"}
    format: ToolFormat | None = None  # auto: calls in free text, in this syntax
    parallel: bool = True  # auto: every call the model writes (False: the first only)

    @property
    def forced(self) -> bool:
        """Whether the whole answer is a tool call."""
        return self.grammar is not None

    @property
    def parses(self) -> bool:
        """Whether the answer is read back into tool calls."""
        return self.forced or self.format is not None

    def parser(self) -> ToolCallParser:
        if self.format is not None:
            return ToolCallParser(tags=(self.format.start, self.format.end), parallel=self.parallel,
                                  listed=self.format.listed)
        return ToolCallParser(name=self.name)


def _tools_source(template: str | None) -> str:
    """The template rendered when tools are given."""
    return str(getattr(template, "tool_use", None) or template or DEFAULT_CHAT_TEMPLATE)


@functools.lru_cache(maxsize=16)
def _renders_tools(source: str) -> bool:
    from jinja2 import meta
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:  # parsed with the extensions rendering has ({% break %} and {% continue %})
        ast = ImmutableSandboxedEnvironment(extensions=[loopcontrols]).parse(source)
    except Exception:  # noqa: BLE001 - an unparsable template renders no tools (render_chat reports it)
        return False
    return "tools" in meta.find_undeclared_variables(ast)


def template_has_tools(template: str | None) -> bool:
    """Whether the chat template reads the `tools` variable (renders the tools)."""
    return _renders_tools(_tools_source(template))


def tool_format(template: str | None) -> ToolFormat | None:
    """The call syntax the template teaches the model, when it renders tools and writes one of
    `TOOL_FORMATS`' tags."""
    source = _tools_source(template)
    if not _renders_tools(source):
        return None
    return next((f for f in TOOL_FORMATS if f.written_by(source)), None)


def _plan_auto(body: ChatRequest, template, tokenizer, rendered: list[dict]) -> ToolPlan:
    fmt = tool_format(template)
    if fmt is None:
        says = "renders tools but writes no tool-call syntax Hyrax can read back (known: " + \
            ", ".join(f"{f.name} {f.start}...{f.end}" for f in TOOL_FORMATS) + ")" \
            if template_has_tools(template) else "has no tool format"
        raise APIError(400, f"tool_choice 'auto' lets the model choose, but this model's chat template {says}; use "
                            "tool_choice 'required' or a named function (answers constrained to the function's "
                            "schema)", param="tool_choice", code="unsupported_parameter")
    if tokenizer is not None:
        for tag in (fmt.start, fmt.end):
            if tag not in tokenizer.decode(tokenizer.encode(tag)):
                raise APIError(400, f"tool_choice 'auto': this model's tokenizer drops {tag} when decoding (a special "
                                    "token), so its calls cannot be read back; use 'required' or a named function",
                               param="tool_choice", code="unsupported_parameter")
    return ToolPlan(rendered, format=fmt, parallel=body.parallel_tool_calls is not False)


async def checked_tools(body: ChatRequest, template: str | None, tokenizer=None) -> ToolPlan:
    """`plan_tools`, run off the event loop when a call is forced: the check of its grammar
    compiles it (see `structured.checked_grammar`)."""
    if not body.tools or body.tool_choice in (None, "none", "auto"):
        return plan_tools(body, template, tokenizer)
    return await asyncio.to_thread(plan_tools, body, template, tokenizer)


def plan_tools(body: ChatRequest, template: str | None, tokenizer=None) -> ToolPlan:
    """What `tools` + `tool_choice` ask of this model; `tokenizer`: checks that auto's call tags
    survive decoding."""
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice", code="invalid_value")
        if body.parallel_tool_calls is not None:  # OpenAI refuses it too
            raise APIError(400, "parallel_tool_calls needs tools", param="parallel_tool_calls", code="invalid_value")
        return ToolPlan()
    choice = choice or "auto"
    rendered = [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools]
    by_name = {t.function.name: t.function for t in body.tools}
    if len(by_name) != len(body.tools):
        raise APIError(400, "tool names must be unique", param="tools", code="invalid_value")
    if choice == "none":  # the model sees the tools and calls none (OpenAI; vLLM's default)
        return ToolPlan(rendered)
    if choice == "auto":
        return _plan_auto(body, template, tokenizer, rendered)
    forced = set(by_name) if choice == "required" else {choice.function.name}  # the tools the answer may call
    for i, t in enumerate(body.tools):
        if t.function.name in forced and not _object_schema(t.function.parameters):
            raise APIError(400, f"tool {t.function.name!r}: a forced call's arguments are a JSON object, so its "
                                "parameters must be the schema of one (\"type\": \"object\" at the root)",
                           param=f"tools.{i}.function.parameters", code="invalid_value")
    if choice == "required":
        # each tool's arguments schema sits under $defs, its references within itself moved with it
        spec = GrammarSpec.json_schema({"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "arguments": {"$ref": f"#/$defs/{n}"}},
             "required": ["name", "arguments"], "additionalProperties": False} for n in by_name],
            "$defs": {n: moved_under(f.parameters or ANY_OBJECT, f"#/$defs/{n}") for n, f in by_name.items()}})
        check(spec, "tools")
        return ToolPlan(rendered, spec, required=True)
    name = choice.function.name
    if name not in by_name:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice",
                       code="invalid_value")
    f = by_name[name]
    spec = GrammarSpec.json_schema(f.parameters or ANY_OBJECT, strict=f.strict is not False)
    check(spec, "tools")
    return ToolPlan(rendered, spec, name=name)


def _object_schema(params: dict | None) -> bool:
    """Whether every value `params` admits is an object (None and {}: any object, the default)."""
    if not params:
        return True
    t = params.get("type")
    if t is None:
        return bool(OBJECT_KEYWORDS & params.keys()) and not any(k in params for k in ALONE)
    return t == "object" or t == ["object"]
