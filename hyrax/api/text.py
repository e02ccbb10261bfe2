"""Text helpers for the gateway: incremental detokenization with stop strings, and chat
templates."""
from __future__ import annotations

import asyncio
import functools

from hyrax.actors.model.text_stream import TextStream  # noqa: F401 - the gateway's text deltas

# Texts longer than this (in all, in characters) are tokenized on a worker thread: the demo
# tokenizer takes about 1 ms per 1,000 characters, and the event loop serves every other client.
OFF_LOOP_CHARS = 4096

DEFAULT_CHAT_TEMPLATE = (
    # Used when the checkpoint's tokenizer_config.json has no chat_template.
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


async def encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text's token ids; long texts (a 4 MB prompt took ~4 s) on a worker thread, so the
    gateway keeps answering others meanwhile (the tokenizer lets go of the GIL while it works)."""
    if sum(map(len, texts)) <= OFF_LOOP_CHARS:
        return [tokenizer.encode(t) for t in texts]
    return await asyncio.to_thread(lambda: [tokenizer.encode(t) for t in texts])


def fewest_tokens(tokenizer, text: str) -> int:
    """A lower bound on `text`'s token count, from its UTF-8 length and the most bytes one token of
    `tokenizer` stands for (its `max_bytes_per_token`: 0 when it declares none). Milliseconds for
    a 4 MB text, which the tokenizer takes seconds over: a prompt this bound already puts over
    the context is refused without tokenizing it."""
    most = getattr(tokenizer, "max_bytes_per_token", None)
    if not most:
        return 0
    return int(len(text.encode("utf-8", "surrogatepass")) // most)


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
