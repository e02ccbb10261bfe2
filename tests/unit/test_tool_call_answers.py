"""Tool calls read back by the chat route, whole and streamed, from answers a replica sends one
token (byte) at a time: a Hermes call whose argument text holds the closing tag
`</tool_call>` is one call with those arguments (the first tag used to end it, cutting the
arguments short and leaving the rest as content); a forced (`required`) call cut short by
max_tokens before its name and arguments began is finish_reason "length" with the text the
model wrote as content (it used to be empty content, the text dropped)."""
from __future__ import annotations

import asyncio
import json

import pytest

from gateway_fakes import EOS, Replica, gateway

HERMES = ("{% if tools %}tools: {{ tools | map(attribute='function.name') | join(', ') }}\n"
          "Call one as <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>\n{% endif %}"
          "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
RUN = {"type": "function", "function": {"name": "run", "parameters": {
    "type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}}
CODE = '{"code": "print(\'</tool_call>\')"}'


class Answering(Replica):
    """Answers every request with `text`, one byte per event, ending as `finish_reason` says
    (with EOS after the text when it is "stop")."""

    def __init__(self, text: str, finish_reason: str):
        self.text, self.finish_reason = text, finish_reason

    def generate(self, request_id, prompt_ids, params):
        ids = list(self.text.encode()) + ([EOS] if self.finish_reason == "stop" else [])

        async def stream():
            for k, t in enumerate(ids):
                await asyncio.sleep(0)
                last = k == len(ids) - 1
                yield {"token_ids": [t], "finished": last, "finish_reason": self.finish_reason if last else None}
        return stream()


def _ask(replica: Replica, stream: bool, **body) -> tuple[dict, str]:
    """(the assistant message, finish_reason) of one chat call; streamed: reassembled from its
    deltas, checking that a call's header comes before its arguments."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [RUN], "stream": stream,
            **body}
    r = gateway(replica, chat_template=HERMES).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    if not stream:
        choice, = r.json()["choices"]
        return choice["message"], choice["finish_reason"]
    content, calls, finish = None, {}, None
    for line in r.text.splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        choice, = json.loads(line[6:])["choices"]
        delta, finish = choice["delta"], choice["finish_reason"] or finish
        if delta.get("content"):
            content = (content or "") + delta["content"]
        for d in delta.get("tool_calls", []):
            if "id" in d:
                calls[d["index"]] = {"id": d["id"], "type": "function", "function": dict(d["function"])}
            else:
                calls[d["index"]]["function"]["arguments"] += d["function"]["arguments"]
    message = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


@pytest.mark.parametrize("stream", [False, True])
def test_a_closing_tag_inside_an_argument_string_does_not_end_the_call(stream):
    answer = f'Running it.\n<tool_call>\n{{"name": "run", "arguments": {CODE}}}\n</tool_call>'
    message, finish = _ask(Answering(answer, "stop"), stream, tool_choice="auto")
    call, = message["tool_calls"]
    assert call["function"] == {"name": "run", "arguments": CODE}, message
    assert json.loads(call["function"]["arguments"]) == {"code": "print('</tool_call>')"}
    assert message["content"] == "Running it." and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_call_whose_string_never_closes_ends_at_its_first_closing_tag(stream):
    """A body that opens a string and never closes it ends at the first closing tag (vLLM's and
    SGLang's Hermes parsers end every call there): it ran on to the answer's end, taking the text
    after the tag into the arguments."""
    answer = '<tool_call>\n{"name": "run", "arguments": {"code": "x</tool_call>\nDone, see above.'
    message, finish = _ask(Answering(answer, "stop"), stream, tool_choice="auto")
    call, = message["tool_calls"]
    assert call["function"] == {"name": "run", "arguments": '{"code": "x'}, message
    assert message["content"] == "Done, see above." and finish == "tool_calls"


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_short_before_its_name_is_finish_length_with_the_text_as_content(stream):
    cut = '{"name": "ru'
    message, finish = _ask(Answering(cut, "length"), stream, tool_choice="required", max_tokens=len(cut))
    assert message == {"role": "assistant", "content": cut} and finish == "length"


@pytest.mark.parametrize("stream", [False, True])
def test_a_required_call_cut_short_in_its_arguments_is_finish_length_with_them(stream):
    cut = '{"name": "run", "arguments": {"code": "pri'
    message, finish = _ask(Answering(cut, "length"), stream, tool_choice="required", max_tokens=len(cut))
    call, = message["tool_calls"]
    assert call["function"] == {"name": "run", "arguments": '{"code": "pri'} and not message["content"]
    assert finish == "length"
