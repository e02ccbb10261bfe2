"""Tool calls: what `tools` + `tool_choice` make of a chat request (the tools the chat template
renders, the grammar the answer must match), and the answer turned back into OpenAI's
`tool_calls`, whole or as stream deltas.

- `none` (the default without tools): a text answer; the template does not see the tools.
- `required`: the answer is `{"name": <one of the tools>, "arguments": <its parameters>}`,
  constrained to the tools' JSON schemas; it becomes one call.
- a named function: the answer is that function's arguments, constrained to its schema.
- `auto` (the default with tools): the model chooses, which needs a template that renders
  tools; with one that has no tool format it is a 400. Hyrax has no parser of a model's own
  tool-call syntax yet, so `auto` is a 400 with such templates too, saying so.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from hyrax.actors.engine.grammar import GrammarSpec
from hyrax.api.errors import APIError
from hyrax.api.schemas import ChatRequest
from hyrax.api.structured import check
from hyrax.api.text import DEFAULT_CHAT_TEMPLATE

ANY_OBJECT = {"type": "object"}


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict] | None = None  # what the chat template renders
    grammar: GrammarSpec | None = None
    name: str | None = None  # a named function: the answer is its arguments
    required: bool = False  # the answer is {"name", "arguments"}

    @property
    def calls(self) -> bool:
        """Whether the answer is a tool call."""
        return self.grammar is not None


def template_has_tools(template: str | None) -> bool:
    """Whether the chat template reads the `tools` variable (renders a tool format)."""
    from jinja2 import meta
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ast = ImmutableSandboxedEnvironment().parse(template or DEFAULT_CHAT_TEMPLATE)
    except Exception:  # noqa: BLE001 - an unparsable template renders no tools (render_chat reports it)
        return False
    return "tools" in meta.find_undeclared_variables(ast)


def plan_tools(body: ChatRequest, template: str | None) -> ToolPlan:
    choice = body.tool_choice
    if not body.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan()
    if choice == "auto":
        if not template_has_tools(template):
            raise APIError(400, "tool_choice 'auto' lets the model choose, but this model's chat template has no tool "
                                "format; use tool_choice 'required' or a named function (answers constrained to the "
                                "function's schema)", param="tool_choice", code="unsupported_parameter")
        raise APIError(400, "tool_choice 'auto' is not supported yet: Hyrax has no parser of this model's tool-call "
                            "syntax; use 'required' or a named function", param="tool_choice",
                       code="unsupported_parameter")
    rendered = [t.model_dump(by_alias=True, exclude_none=True) for t in body.tools]
    by_name = {t.function.name: t.function for t in body.tools}
    if len(by_name) != len(body.tools):
        raise APIError(400, "tool names must be unique", param="tools")
    if choice == "required":
        spec = GrammarSpec.json_schema({"anyOf": [
            {"type": "object", "properties": {"name": {"const": n}, "arguments": f.parameters or ANY_OBJECT},
             "required": ["name", "arguments"], "additionalProperties": False} for n, f in by_name.items()]})
        check(spec, "tools")
        return ToolPlan(rendered, spec, required=True)
    name = choice.function.name
    if name not in by_name:
        raise APIError(400, f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
    f = by_name[name]
    spec = GrammarSpec.json_schema(f.parameters or ANY_OBJECT, strict=f.strict is not False)
    check(spec, "tools")
    return ToolPlan(rendered, spec, name=name)


_HEAD = re.compile(r'\{\s*"name"\s*:\s*"([A-Za-z0-9_-]{1,64})"\s*,\s*"arguments"\s*:\s*')


@dataclass
class ToolCallStream:
    """One choice's answer as one tool call: text deltas in, `delta.tool_calls` entries out.
    The call's header (index, id, type, name) goes first, then the arguments in pieces."""

    plan: ToolPlan
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    text: str = ""
    name: str | None = None
    arguments: str = ""
    _args_from: int = -1  # where the arguments start in `text`, once the header is known
    _sent_header: bool = False

    def __post_init__(self):
        if self.plan.name is not None:
            self.name, self._args_from = self.plan.name, 0

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        if self._args_from < 0:
            m = _HEAD.match(self.text)
            if m is None:
                return []
            self.name, self._args_from = m.group(1), m.end()
        hold = 1 if self.plan.required else 0  # may be the closing brace of {"name", "arguments"}
        return self._emit(self.text[self._args_from:max(len(self.text) - hold, self._args_from)])

    def finish(self) -> list[dict]:
        """The rest, once the answer is complete (or cut short)."""
        if self._args_from < 0:
            return []
        rest = self.text[self._args_from:]
        if self.plan.required and _parses(self.text) and rest.endswith("}"):
            rest = rest[:-1]
        return self._emit(rest)

    def _emit(self, arguments: str) -> list[dict]:
        out = []
        if not self._sent_header:
            self._sent_header = True
            out.append({"index": 0, "id": self.id, "type": "function",
                        "function": {"name": self.name, "arguments": ""}})
        if len(arguments) > len(self.arguments):
            out.append({"index": 0, "function": {"arguments": arguments[len(self.arguments):]}})
            self.arguments = arguments
        return out

    def calls(self) -> list[dict]:
        """The whole call, for a non-streaming answer (after `feed` of the text and `finish`)."""
        if self.name is None:
            return []
        return [{"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}]


def _parses(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
