"""The context rule every request obeys, written once for the HTTP routes and `hyrax generate`:
the prompt leaves room for at least one token, and max_tokens fits in what it leaves. A request
that breaks it is refused (HTTP: 400 `context_length_exceeded`; CLI: a one-line error), never
run to finish "length"."""
from __future__ import annotations

from hyrax.actors.model.errors import HyraxInputError


class ContextExceeded(HyraxInputError):
    """`over`: what does not fit, "prompt" (no room left) or "max_tokens"."""

    def __init__(self, message: str, over: str):
        super().__init__(message)
        self.over = over


def completion_budget(prompt_tokens: int, max_tokens: int | None, default_max: int | None, context: int, *,
                      max_tokens_name: str = "max_tokens", at_least: bool = False) -> int:
    """The tokens a request of `prompt_tokens` may generate: `max_tokens` when given, else
    `default_max` (None: no default) capped to the room the prompt leaves. ContextExceeded when
    the prompt leaves no room, or `max_tokens` is more than the room. `max_tokens_name`: how the
    caller spells the option (`--max-tokens`); `at_least`: `prompt_tokens` is a lower bound on
    the prompt's length, not its count (a long text refused before it is tokenized)."""
    room = context - prompt_tokens
    n = f"at least {prompt_tokens}" if at_least else f"{prompt_tokens}"
    if room < 1:
        raise ContextExceeded(f"prompt has {n} tokens; the model's context is {context} tokens", "prompt")
    if max_tokens is None:
        return min(default_max or room, room)
    if max_tokens > room:
        raise ContextExceeded(f"prompt ({n} tokens) + {max_tokens_name} ({max_tokens}) exceeds the model's context "
                              f"of {context} tokens", "max_tokens")
    return max_tokens
