"""Almost-but-not-quite tool calls in an `auto` answer, read back whole and streamed (split at
every position, and one character at a time). A Nemotron-style list whose items are not all call
bodies drops those items only, as docs/api.md says: before, the first stray item (a number, a
string, a list) ended the reading of the list and the calls after it were lost."""
from __future__ import annotations

import pytest

from test_tool_parser import LISTED, _check

STRAY_ITEMS = [
    ('<TOOLCALL>[{"name": "f", "arguments": {}}, 5, {"name": "g", "arguments": {"x": 1}}]</TOOLCALL>',
     None, [("f", "{}"), ("g", '{"x": 1}')]),
    ('<TOOLCALL>[{"name": "f", "arguments": {}}, "a, ]\\" {", {"name": "g", "arguments": {}}]</TOOLCALL>',
     None, [("f", "{}"), ("g", "{}")]),
    ('<TOOLCALL>[[1, {"name": "h"}], true, {"name": "g", "arguments": []}]</TOOLCALL>', None, [("g", "[]")]),
    ('Sure. <TOOLCALL>[null, {"name": "g", "arguments": {}}, -1.5e3]</TOOLCALL>', "Sure.", [("g", "{}")]),
    ('<TOOLCALL>[{"name": "f", "arguments": {}}}, :x, {"name": "g", "arguments": {}}]</TOOLCALL>',
     None, [("f", "{}"), ("g", "{}")]),
    ("<TOOLCALL>[1, \"two\", [3]]</TOOLCALL> done", "<TOOLCALL>[1, \"two\", [3]]</TOOLCALL> done", []),
]


@pytest.mark.parametrize("answer,content,calls", STRAY_ITEMS)
def test_stray_items_of_a_listed_block_are_dropped_and_the_calls_after_them_kept(answer, content, calls):
    for i in range(len(answer) + 1):
        _check([answer[:i], answer[i:]], content, calls, **LISTED)
    _check(list(answer), content, calls, **LISTED)
