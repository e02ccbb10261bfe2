"""Text helpers for the gateway: incremental detokenization with stop strings, and chat
templates."""
from __future__ import annotations

import functools

DEFAULT_CHAT_TEMPLATE = (
    # Used when the checkpoint's tokenizer_config.json has no chat_template.
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class TextStream:
    """Turns a growing list of token ids into text deltas, incrementally: each feed decodes
    only the new ids with a few ids of context before them (as vLLM's incremental
    detokenizer does), so a long answer costs the same per token as a short one.

    Holds back text that may still change: a trailing incomplete UTF-8 sequence (decoded as
    U+FFFD), and a tail that could be the start of a stop string. Text from the first stop
    string on is never emitted.
    """

    def __init__(self, decode, stop: tuple[str, ...] = ()):
        self.decode = decode
        self.stop = tuple(s for s in stop if s)
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:read]; only ever appended to
        self.prefix = 0  # ids[prefix:read]: the context the next decode starts from
        self.read = 0
        self.searched = 0  # no stop string starts before this offset of `text`
        self.out: list[str] = []  # the deltas emitted
        self.sent = 0  # characters emitted
        self.stopped = False

    def _pending(self) -> str:
        """Decode the ids not yet in `text`; a result that ends in an incomplete character is
        returned as pending (it may still change) and not committed."""
        if self.read == len(self.ids):
            return ""
        before = self.decode(self.ids[self.prefix:self.read])
        after = self.decode(self.ids[self.prefix:])
        if not after.startswith(before):  # context changed the earlier text: decode it all once
            whole = self.decode(self.ids)
            before, after = self.text, whole if whole.startswith(self.text) else self.text + whole[len(self.text):]
        if after.endswith("\ufffd"):
            return after[len(before):]
        self.text += after[len(before):]
        self.prefix, self.read = self.read, len(self.ids)
        return ""

    def _visible(self, final: bool) -> str:
        pending = self._pending()
        text = self.text + (pending if final else pending.rstrip("\ufffd"))
        start = max(0, self.searched - max((len(s) for s in self.stop), default=1) + 1)
        cut = min((i for i in (text.find(s, start) for s in self.stop) if i >= 0), default=-1)
        self.searched = len(self.text)
        if cut >= 0:
            self.stopped = True
            return text[:cut]
        if final:
            return text
        hold = 0
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
        return "".join(self.out)

    def _take(self, visible: str) -> str:
        if len(visible) <= self.sent:
            return ""
        delta = visible[self.sent :]
        self.sent = len(visible)
        self.out.append(delta)
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


@functools.lru_cache(maxsize=8)
def _compile(source: str):
    """The Jinja environment of transformers' apply_chat_template (immutable sandbox, trim and
    lstrip blocks, loop controls, tojson, raise_exception, strftime_now, a `namespace` that
    refuses underscore names and a `dict` that is only a constructor), compiled once per template."""
    from jinja2.exceptions import SecurityError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from jinja2.utils import Namespace

    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"chat template: namespace attribute {name!r} starts with an underscore")

    class TemplateNamespace(Namespace):
        def __init__(*args, **kwargs):  # Namespace's own signature trick, so namespace(self=...) works
            attrs = dict(*args[1:], **kwargs)
            for name in attrs:
                check(name)
            Namespace.__init__(args[0], attrs)

        def __setitem__(self, name, value):
            check(name)
            Namespace.__setitem__(self, name, value)

    class TemplateDict:
        def __call__(self, *args, **kwargs):
            return dict(*args, **kwargs)

        def fromkeys(self, *args, **kwargs):
            return dict.fromkeys(*args, **kwargs)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise, strftime_now=_strftime_now, namespace=TemplateNamespace,
                       dict=TemplateDict())
    return env.from_string(source)


def template_error(e: Exception) -> str:
    """What a client is told when its conversation cannot be rendered: the template's own
    message when it refused the conversation (`raise_exception`), else only the kind of error."""
    from hyrax.actors.model.errors import HyraxInputError

    return f"cannot apply the {e}" if isinstance(e, HyraxInputError) else \
        f"cannot apply the chat template: {type(e).__name__}"


def render_chat(template: str | None, messages: list[dict], add_generation_prompt: bool = True,
                tools: list | None = None):
    """Render messages with the checkpoint's Jinja template, or the default, the way
    transformers' `apply_chat_template` does: an immutable sandbox with trim_blocks,
    lstrip_blocks and loop controls, `tojson`, `raise_exception` and `strftime_now`, and the
    variables messages (on a copy without None-valued keys), add_generation_prompt, tools and
    documents (None when not given), and the checkpoint's named special tokens (bos_token,
    eos_token, pad_token, ...). With tools, a checkpoint's "tool_use" template is preferred.
    Returns a `ChatPrompt`, which the tokenizer encodes without adding special tokens."""
    from hyrax.actors.model.tokenizer import ChatPrompt

    source = (getattr(template, "tool_use", None) if tools is not None else None) or template
    messages = [{k: v for k, v in m.items() if v is not None} if isinstance(m, dict) else m for m in messages]
    return ChatPrompt(_compile(str(source or DEFAULT_CHAT_TEMPLATE)).render(
        **getattr(template, "special_tokens", {}), messages=messages, tools=tools, documents=None,
        add_generation_prompt=add_generation_prompt,
    ))
