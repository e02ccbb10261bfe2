"""A long text is tokenized off the gateway's event loop: a 4 MB prompt took the demo tokenizer
about 4 s, during which every other client of the gateway waited (only to be told that the
prompt is over the context), and /tokenize of 4 MB took 3.7 s. The tokenizer here records
whether it ran on a thread with a running event loop; no timing is asserted."""
from __future__ import annotations

import asyncio

import pytest

from gateway_fakes import EOS, gateway
from hyrax.actors.model.tokenizer import ByteTokenizer

LONG = "a" * 100_000  # over the context of gateway_fakes' model (2048 tokens)


class WhereTokenizer(ByteTokenizer):
    """Records (characters, on an event loop's thread) for every text it encodes. It declares 64
    bytes a token at most (true, if loose: a byte tokenizer's is 1), so that the gateway's bound
    (100,000 / 64 < 2048) does not refuse LONG before counting it (test_early_context_refusal.py)."""

    max_bytes_per_token = 64

    def __init__(self):
        super().__init__(264, EOS)
        self.calls = []

    def encode(self, text: str) -> list[int]:
        try:
            on_loop = asyncio.get_running_loop() is not None
        except RuntimeError:
            on_loop = False
        self.calls.append((len(text), on_loop))
        return super().encode(text)


CALLS = [  # (path, body, status)
    ("/v1/completions", {"model": "m", "prompt": LONG}, 400),
    ("/v1/completions", {"model": "m", "prompt": ["hi", LONG]}, 400),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": LONG}]}, 400),
    ("/tokenize", {"prompt": LONG}, 200),
    ("/tokenize", {"messages": [{"role": "user", "content": LONG}]}, 200),
]


@pytest.mark.parametrize("path,body,status", CALLS, ids=[f"{c[0]}:{i}" for i, c in enumerate(CALLS)])
def test_a_long_text_is_tokenized_off_the_event_loop(path, body, status):
    tok = WhereTokenizer()
    r = gateway(tokenizer=tok).post(path, json=body)
    assert r.status_code == status, r.text
    if status == 400:
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text
    long = [on_loop for n, on_loop in tok.calls if n >= len(LONG)]
    assert long == [False], tok.calls
