"""Incremental detokenisation with stop strings, shared by the gateway (the text it streams)
and the engine (when a stop string ends a request)."""
from __future__ import annotations


from typing import Sequence

PROMPT_CONTEXT = 5  # prompt tokens an answer is decoded after (vLLM's incremental detokenizer reads as many)


class TextStream:
    """Turns a growing list of token ids into text deltas, incrementally: each feed decodes
    only the new ids with a few ids of context before them (as vLLM's incremental
    detokenizer does), so a long answer costs the same per token as a short one.

    The answer's first tokens are decoded after the prompt's last few (`after_prompt`), as the
    text they continue: a SentencePiece-style decoder drops the leading space of a text's first
    token, so decoded alone an answer '▁Hello ▁world' read 'Hello world' where vLLM answers
    ' Hello world'. Byte-level tokenizers decode the same either way.

    Holds back text that may still change: a trailing incomplete UTF-8 sequence (decoded as
    U+FFFD), and a tail that could be the start of a stop string. Text from the first stop
    string on is never emitted.
    """

    def __init__(self, decode, stop: tuple[str, ...] = (), context: Sequence[int] = ()):
        self.decode = decode
        self.stop = tuple(s for s in stop if s)
        self.context = list(context)  # ids the answer continues: decoded before it, never part of it
        self.ids: list[int] = []
        self.text = ""  # the decoded text of ids[:read]; only ever appended to
        self.prefix = 0  # ids[prefix:read]: the context the next decode starts from
        self.read = 0
        self.searched = 0  # no stop string starts before this offset of `text`
        self.out: list[str] = []  # the deltas emitted
        self.sent = 0  # characters emitted
        self.stopped = False

    @classmethod
    def after_prompt(cls, decode, prompt_ids: Sequence[int], stop: tuple[str, ...] = ()) -> TextStream:
        """The stream of an answer to `prompt_ids`, decoded after its last `PROMPT_CONTEXT` ids.
        The gateway (the text it streams) and the engine (where a stop string ends the request)
        both make theirs so, and so read the same text."""
        return cls(decode, stop, prompt_ids[-PROMPT_CONTEXT:] if PROMPT_CONTEXT else ())

    def _decode(self, start: int, end: int | None = None) -> str:
        """ids[start:end] as text; from the first id, as the text after `context`."""
        if start or not self.context:
            return self.decode(self.ids[start:end])
        lead = self.decode(self.context)
        text = self.decode(self.context + self.ids[:end])
        # the context's own text, then the ids': else (context and ids joined into one character) the ids' alone
        return text[len(lead):] if text.startswith(lead) and not lead.endswith("\ufffd") else self.decode(self.ids[:end])

    def _pending(self) -> str:
        """Decode the ids not yet in `text`; a result that ends in an incomplete character is
        returned as pending (it may still change) and not committed."""
        if self.read == len(self.ids):
            return ""
        before = self._decode(self.prefix, self.read)
        after = self._decode(self.prefix)
        if not after.startswith(before):  # context changed the earlier text: decode it all once
            whole = self._decode(0)
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
