"""Text helpers for the gateway: incremental detokenization with stop strings, and chat
templates."""
from __future__ import annotations

DEFAULT_CHAT_TEMPLATE = (
    # Used when the checkpoint's tokenizer_config.json has no chat_template.
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TextStream:
    """Turns a growing list of token ids into text deltas.

    Holds back text that may still change: a trailing incomplete UTF-8 sequence (decoded as
    U+FFFD), and a tail that could be the start of a stop string. Text from the first stop
    string on is never emitted.
    """

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode = decode
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.sent = 0  # characters of the final text already emitted
        self.stopped = False

    def _visible(self, final: bool) -> str:
        text = self.decode(self.ids)
        cut = min((text.find(s) for s in self.stop if s in text), default=-1)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        if final:
            return text
        hold = 0
        while hold < len(text) and text[len(text) - 1 - hold] == "\ufffd":
            hold += 1
        for s in self.stop:
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        return text[: len(text) - hold]

    def feed(self, token_ids: list[int]) -> str:
        if self.stopped:
            return ""
        self.ids.extend(token_ids)
        return self._take(self._visible(final=False))

    def finish(self) -> str:
        if self.stopped:
            return ""
        return self._take(self._visible(final=True))

    @property
    def emitted(self) -> str:
        """All text emitted so far (after `finish`, the whole visible completion)."""
        return self.decode(self.ids)[: self.sent]

    def _take(self, visible: str) -> str:
        if len(visible) <= self.sent:
            return ""
        delta = visible[self.sent :]
        self.sent = len(visible)
        return delta


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    import json

    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str):
    from hyrax.actors.model.errors import HyraxInputError

    raise HyraxInputError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    from datetime import datetime

    return datetime.now().strftime(fmt)


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                tools: list | None = None):
    """Render messages with the checkpoint's Jinja template, or the default, the way
    transformers' `apply_chat_template` does: an immutable sandbox with trim_blocks,
    lstrip_blocks and loop controls, `tojson`, `raise_exception` and `strftime_now`, and the
    variables messages, add_generation_prompt, bos_token, eos_token (and tools when given).
    Returns a `ChatPrompt`, which the tokenizer encodes without adding special tokens."""
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from hyrax.actors.model.tokenizer import ChatPrompt

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = _strftime_now
    extra = {"tools": tools} if tools is not None else {}
    return ChatPrompt(env.from_string(template or DEFAULT_CHAT_TEMPLATE).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=getattr(template, "bos_token", ""), eos_token=getattr(template, "eos_token", ""), **extra,
    ))
