"""`tool_choice: "none"` with `tools`: the chat template still renders the tools, and the answer
is free text that is not read back as calls, as in OpenAI's API (the model sees the tools but
calls none) and vLLM's default. The tools used to be left out of the prompt."""
from __future__ import annotations

import pytest

from gateway_fakes import EOS, Replica, gateway

TEMPLATE = ("{% if tools %}tools: {{ tools | map(attribute='function.name') | join(', ') }}\n{% endif %}"
            "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}")
TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


class Recording(Replica):
    """Answers every request with `<tool_call>` text and EOS; keeps what it was asked."""

    def __init__(self):
        self.asked = []

    def generate(self, request_id, prompt_ids, params):
        self.asked.append((prompt_ids, params))

        async def stream():
            yield {"token_ids": [*b"<tool_call>", EOS], "finished": True, "finish_reason": "stop"}
        return stream()


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_none_shows_the_tools_to_the_model_and_reads_no_call(stream):
    replica = Recording()
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [TOOL], "tool_choice": "none",
            "stream": stream}
    r = gateway(replica, chat_template=TEMPLATE).post("/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text
    (prompt, params), = replica.asked
    assert bytes(prompt).decode() == "tools: get_weather\nuser: hi\n"
    assert "grammar" not in params
    assert "tool_calls" not in r.text and "<tool_call>" in r.text
