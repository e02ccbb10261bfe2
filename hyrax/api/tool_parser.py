"""A chat answer read back as OpenAI's assistant message: `content` and `tool_calls`, whole (for
a non-streaming answer) or as stream deltas, from one implementation, so a reassembled stream
equals the non-streaming answer.

A call's body is `{"name": <str>, "arguments": <JSON>}`. Its header (index, id, type, name) is
sent as soon as the name is known, then the arguments' text in pieces, exactly as the model
wrote it. Three shapes of answer:

- a named function (forced): the whole answer is that function's arguments;
- `required` (forced): the whole answer is one call body; an answer cut short (max_tokens)
  before the body's name and the start of its arguments is no call, and comes back as content
  as written (cut short later, it is a call with the arguments written so far, as OpenAI's);
- `auto`: free text in which each call is a body between the template's tags
  (`<tool_call>...</tool_call>` for Hermes-style templates), or each tagged block is a JSON
  array of bodies (`<TOOLCALL>[...]</TOOLCALL>` for Nemotron-style ones). Text outside the tags
  is content; whitespace around a call is dropped. A closing tag inside a JSON string of the
  block's body (`{"code": "print('</tool_call>')"}`) is part of that string: a block ends at the
  first closing tag outside the strings of its body. That holds only for a body that ends (its
  JSON value closes): one whose string is never closed (`{"a": "x</tool_call> more text`) ends
  at that first tag, as vLLM's and SGLang's Hermes parsers end every call, and the text after it
  is read as the answer's rest. Until the body's end or a closing tag outside its strings tells
  which, the text after such a tag is held back (streamed or whole alike). A tagged block with
  no call in it stays in the content as written; an unclosed block at the end is closed there.
"""
from __future__ import annotations

import json
import re
import uuid

_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"([^"\\]{1,64})"\s*,\s*"arguments"\s*:')


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class _ValueScan:
    """Finds where one JSON value ends in text that arrives in pieces (strings, escapes and
    nesting tracked; the value is not validated). `start`: its first character; `end`: one past
    its last, once it is complete."""

    def __init__(self):
        self.start: int | None = None
        self.end: int | None = None
        self._pos = 0
        self._depth = 0
        self._in_str = self._esc = False

    @property
    def in_string(self) -> bool:
        """Whether the text scanned so far ends inside a string of a value that is not complete."""
        return self._in_str and self.end is None

    def scan(self, text: str) -> None:
        while self.end is None and self._pos < len(text):
            ch, i = text[self._pos], self._pos
            self._pos += 1
            if self.start is None:
                if ch.isspace():
                    continue
                self.start = i
            if self._in_str:
                if self._esc:
                    self._esc = False
                elif ch == "\\":
                    self._esc = True
                elif ch == '"':
                    self._in_str = False
                    if self._depth == 0:
                        self.end = i + 1
            elif ch == '"':
                self._in_str = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth <= 0:  # the value closed, or a bare scalar met its container's end
                    self.end = i + 1 if self._depth == 0 else i
            elif self._depth == 0 and (ch == "," or ch.isspace()):
                self.end = i  # a bare scalar (number, true, ...) ended


class _Call:
    """One call's body arriving in pieces; `name` given: the body is the arguments alone."""

    def __init__(self, index: int, name: str | None = None):
        self.index, self.name = index, name
        self.id = f"call_{uuid.uuid4().hex[:24]}"
        self.text = ""
        self.arguments = ""  # sent so far
        self.started = False  # header sent
        self._args_from = 0 if name is not None else -1
        self._scan = _ValueScan()

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        if self._args_from < 0:
            m = _HEAD.match(self.text)
            if m is None:
                return []
            self.name, self._args_from = m.group(1), m.end()
        return self._send(self._args(final=False))

    def close(self) -> list[dict] | None:
        """The body is complete: the rest of the call; None when the body is no call at all."""
        if self._args_from >= 0:
            return self._send(self._args(final=True))
        try:  # the name did not come first: read the whole body
            body = json.loads(self.text)
        except ValueError:
            return None
        if not (isinstance(body, dict) and isinstance(body.get("name"), str) and "arguments" in body):
            return None
        self.name, args = body["name"], body["arguments"]
        return self._send(args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))

    def _args(self, final: bool) -> str:
        rest = self.text[self._args_from:]
        self._scan.scan(rest)
        if self._scan.start is None:
            return ""
        if self._scan.end is not None:
            return rest[self._scan.start:self._scan.end]
        # unfinished: trailing whitespace may still be followed by the value's end (then it is
        # kept) or by the body's end (then it is not part of the arguments)
        return rest[self._scan.start:].rstrip()

    def _send(self, arguments: str) -> list[dict]:
        out = []
        if not self.started:
            self.started = True
            out.append({"index": self.index, "id": self.id, "type": "function",
                        "function": {"name": self.name, "arguments": ""}})
        if len(arguments) > len(self.arguments) and arguments.startswith(self.arguments):
            out.append({"index": self.index, "function": {"arguments": arguments[len(self.arguments):]}})
            self.arguments = arguments
        return out

    def as_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


class _Block:
    """One tagged block of an `auto` answer: a call body, or (`listed`) a JSON array of them.
    Its calls join `calls`, the answer's, as their headers go out."""

    def __init__(self, calls: list[_Call], listed: bool):
        self.calls, self.listed = calls, listed
        self.text = ""
        self.made = 0  # calls of this block
        self._open: _Call | None = None if listed else _Call(len(calls))
        self._pos = 0  # listed: text before this is read
        self._from = 0  # listed: where the open call's body starts
        self._scan = _ValueScan()  # listed: the open call's body
        self._stray: _ValueScan | None = None  # listed: an item that is no call body, skipped to its end
        self._stray_from = 0
        self._state = "start"  # listed: start (before '['), items, done, or bad (not a list of calls)

    def feed(self, piece: str) -> list[dict]:
        self.text += piece
        if not self.listed:
            return self._feed_open(piece)
        out = []
        while self._pos < len(self.text) and self._state in ("start", "items"):
            if self._open is not None:
                self._scan.scan(self.text[self._from:])
                upto = len(self.text) if self._scan.end is None else self._from + self._scan.end
                out += self._feed_open(self.text[self._pos:upto])
                self._pos = upto
                if self._scan.end is None:
                    break
                out += self._close_open()
                continue
            if self._stray is not None:
                self._stray.scan(self.text[self._stray_from:])
                if self._stray.end is None:
                    self._pos = len(self.text)
                    break
                self._pos, self._stray = self._stray_from + max(self._stray.end, 1), None  # a stray '}' ends at 0
                continue
            ch = self.text[self._pos]
            if ch.isspace() or (ch == "," and self._state == "items"):
                self._pos += 1
            elif ch == "[" and self._state == "start":
                self._state, self._pos = "items", self._pos + 1
            elif ch == "]" and self._state == "items":
                self._state, self._pos = "done", self._pos + 1
            elif ch == "{":  # a call body (a bare one, without the array, is read too)
                self._state, self._from = "items", self._pos
                self._open, self._scan = _Call(len(self.calls)), _ValueScan()
            elif self._state == "items":  # a stray item (a number, a string, a list): dropped
                self._stray, self._stray_from = _ValueScan(), self._pos
            else:
                self._state = "bad"
        return out

    def close(self) -> list[dict] | None:
        """The block is complete: the rest of its calls; None when it holds none."""
        out = self._close_open() if self._open is not None else []
        return out if self.made else None

    def _feed_open(self, piece: str) -> list[dict]:
        parts = self._open.feed(piece)
        self._joined()
        return parts

    def _close_open(self) -> list[dict]:
        parts = self._open.close()
        if parts is not None:
            self._joined()
        self._open = None
        return parts or []

    def _joined(self) -> None:
        if self._open.started and self._open not in self.calls:
            self.calls.append(self._open)
            self.made += 1


class ToolCallParser:
    """One choice's answer: `feed(text delta)` and `finish()` return (content delta, tool_calls
    deltas); `message()` is the whole assistant message once finished.

    Without `tags` the answer is one forced call: that function's arguments with `name`, else a
    whole call body (`required`). With `tags` = (start, end), calls are delimited in free text
    (`listed`: each block holds a JSON array of call bodies), and `parallel` False keeps only the
    first call (what follows it is dropped)."""

    def __init__(self, name: str | None = None, tags: tuple[str, str] | None = None, parallel: bool = True,
                 listed: bool = False):
        self.tags, self.parallel, self.listed = tags, parallel, listed
        self.content = ""
        self.calls: list[_Call] = []
        self._buf = ""  # text not yet told apart (a possible tag start, whitespace)
        self._block: _Block | None = None  # auto: the open tagged block
        self._body = _ValueScan()  # auto: the open block's body, to tell a closing tag in one of its strings
        self._held = False  # auto: _buf starts with a closing tag inside a string of a body not yet ended
        self._held_from = 0  # held: the closing tags in _buf before this are in the body's strings
        self._done = False  # parallel=False and the first call is complete
        self._gap = ""  # whitespace between the text and the open block's tag
        self._after_call = False  # whitespace from here on is dropped
        if tags is None:
            self._call = _Call(0, name)
            self.calls.append(self._call)

    @property
    def forced(self) -> bool:
        return self.tags is None

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        if self.forced:
            return "", self._call.feed(delta)
        self._buf += delta
        return self._read(final=False)

    def _read(self, final: bool) -> tuple[str, list[dict]]:
        """Read `_buf` as far as it can be told apart; `final`: the answer is complete, so a
        held closing tag ends its block."""
        text, parts = "", []
        while not self._done:
            start, end = self.tags
            if self._block is None:
                if self._after_call:  # whitespace after a call is dropped
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        break
                    self._after_call = False
                i = self._buf.find(start)
                if i < 0:
                    head = self._buf[:len(self._buf) - _partial_tag(self._buf, start)].rstrip()
                    text, self._buf = text + head, self._buf[len(head):]
                    break
                head = self._buf[:i].rstrip()
                text, self._gap = text + head, self._buf[len(head):i]  # the gap goes if a call follows
                self._buf = self._buf[i + len(start):]
                self._block, self._body = _Block(self.calls, self.listed), _ValueScan()
                continue
            if self._held:
                ended = self._held_body_ends(end)
                if ended is None and not final:
                    break
                self._held = False
                if ended:  # the held tag was the string's: the body, through its end, is the block's
                    upto = self._body.end - len(self._block.text)
                    parts += self._block_feed(self._buf[:upto])
                    self._buf = self._buf[upto:]
                    continue
                # a body that never ends: its block ends at the held tag
                self._buf = self._buf[len(end):]
                text, more = self._close(text, end)
                parts += more
                continue
            j = self._buf.find(end)
            if j >= 0 and self._in_body_string(self._block.text + self._buf[:j]):
                parts += self._block_feed(self._buf[:j])
                self._buf, self._held, self._held_from = self._buf[j:], True, len(end)
                continue
            if j < 0:
                keep = _partial_tag(self._buf, end)
                parts += self._block_feed(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            parts += self._block_feed(self._buf[:j])
            self._buf = self._buf[j + len(end):]
            text, more = self._close(text, end)
            parts += more
        return self._said(text), parts

    def finish(self) -> tuple[str, list[dict]]:
        """The rest, once the answer is complete (or cut short)."""
        if self.forced:
            parts = self._call.close()
            if parts is None:  # no call: cut short before its name and arguments began, the text as written
                return self._said(self._call.text), []
            return "", parts
        said, parts = self._read(final=True)  # a held tag ends its block: the rest read after it
        text = ""
        if not self._done and self._block is not None:  # an unclosed block: closed by the answer's end
            parts += self._block_feed(self._buf)
            self._buf = ""
            text, more = self._close(text, "")
            parts += more
        if not self._done and (self._buf.strip() or not self.made_calls):
            text += self._buf
        self._buf = ""
        return said + self._said(text), parts

    def message(self) -> dict:
        calls = [c.as_openai() for c in self.calls if c.started]
        if not calls:
            return {"role": "assistant", "content": self.content}
        return {"role": "assistant", "content": self.content or None, "tool_calls": calls}

    @property
    def made_calls(self) -> bool:
        return any(c.started for c in self.calls)

    def _held_body_ends(self, end: str) -> bool | None:
        """`_buf` starts with a closing tag inside a string of the open block's body. True: the
        body ends after it (the tag is the string's text); False: a closing tag outside the
        body's strings comes before its end (the string was never closed); None: not yet told."""
        base = self._block.text
        k = self._buf.find(end, self._held_from)
        while k >= 0 and self._in_body_string(base + self._buf[:k]):
            self._held_from = k + 1
            k = self._buf.find(end, k + 1)
        if k < 0:  # no tag left to tell by: read up to a possible tag start
            self._held_from = len(self._buf) - _partial_tag(self._buf, end)
            self._body.scan(base + self._buf[:self._held_from])
        if self._body.end is not None:
            return True
        return False if k >= 0 else None

    def _in_body_string(self, text: str) -> bool:
        """Whether `text`, the open block's text so far, ends inside a string of its body."""
        self._body.scan(text)
        return self._body.in_string and text[self._body.start] in "{["

    def _block_feed(self, piece: str) -> list[dict]:
        parts = self._block.feed(piece)
        if parts and not self.parallel:  # the first call only: nothing past it
            first = self.calls[0].index
            parts = [p for p in parts if p["index"] == first]
            del self.calls[1:]
        return parts

    def _close(self, text: str, end: str) -> tuple[str, list[dict]]:
        """The open tagged block is complete: calls, or text as written."""
        block, self._block = self._block, None
        parts = block.close()
        if parts is None:
            return text + self._gap + self.tags[0] + block.text + end, []
        if not self.parallel:
            parts = [p for p in parts if p["index"] == self.calls[0].index]
            del self.calls[1:]
        self._done, self._after_call = not self.parallel, True
        return text, parts

    def _said(self, text: str) -> str:
        self.content += text
        return text
