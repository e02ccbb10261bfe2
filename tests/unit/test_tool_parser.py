"""tool_choice "auto" (issue 19): a chat answer in free text is read back into OpenAI's content
and `tool_calls`. The parser is checked on text (every shape of answer, and every text split
into two deltas at every position, and one character at a time, reassembling to the same
message), on real token streams decoded by the gateway's TextStream (a Qwen-style tokenizer
whose <tool_call> tags are ordinary added tokens, and the demo model's byte-level tokenizer),
and the plan: which templates have a call syntax Hyrax reads, and the clear 400s otherwise."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from hyrax.actors.model.tokenizer import chat_template, load_tokenizer
from hyrax.api.errors import APIError
from hyrax.api.schemas import ChatRequest
from hyrax.api.text import TextStream, render_chat
from hyrax.api.tool_parser import ToolCallParser
from hyrax.api.tools import plan_tools, tool_format

tokenizers = pytest.importorskip("tokenizers")

DEMO = str(Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo")
TAGS = ("<tool_call>", "</tool_call>")
LISTED = {"tags": ("<TOOLCALL>", "</TOOLCALL>"), "listed": True}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

# (answer, expected content, expected [(name, arguments text)])
ANSWERS = [
    ("Hello there.", "Hello there.", []),
    ("  spaced answer \n", "  spaced answer \n", []),  # no call: the text exactly, whitespace included
    ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     None, [("get_weather", '{"city": "Oslo"}')]),
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n',
     "Let me look.", [("get_weather", '{"city": "Oslo"}')]),
    ('<tool_call>{"name": "a", "arguments": {"s": "}{\\"</tool", "n": [1, {"x": null}]}}</tool_call>\n'
     '<tool_call>{"name": "b", "arguments": {}}</tool_call>',
     None, [("a", '{"s": "}{\\"</tool", "n": [1, {"x": null}]}'), ("b", "{}")]),
    ('<tool_call>{"arguments": {"k": 2}, "name": "late_name"}</tool_call>', None, [("late_name", '{"k": 2}')]),
    ("a <tool_call>not json</tool_call> b", "a <tool_call>not json</tool_call> b", []),
    ("x < y and <tool is not a tag", "x < y and <tool is not a tag", []),
    ('<tool_call>{"name": "get_weather", "arguments": {"city": "Ber', None, [("get_weather", '{"city": "Ber')]),
    ('<tool_call>{"name": "f", "arguments": 7}</tool_call> and then text', "and then text", [("f", "7")]),
    ('Sí — 東京 <tool_call>{"name": "get_weather", "arguments": {"city": "東京"}}</tool_call>',
     "Sí — 東京", [("get_weather", '{"city": "東京"}')]),
    # a closing tag inside a string of the body is that string's text, not the block's end
    ('<tool_call>{"name": "run", "arguments": {"code": "print(\'</tool_call>\')"}}</tool_call> ran',
     "ran", [("run", '{"code": "print(\'</tool_call>\')"}')]),
    ('<tool_call>{"name": "run", "arguments": {"a": "</tool_call>", "b": ["\\"</tool_call>"]}}</tool_call>'
     '<tool_call>{"name": "f", "arguments": {}}</tool_call>',
     None, [("run", '{"a": "</tool_call>", "b": ["\\"</tool_call>"]}'), ("f", "{}")]),
    ('<tool_call>say "hi</tool_call> then', '<tool_call>say "hi</tool_call> then', []),  # prose: the first tag
    # a string the body never closes: the block ends at its first closing tag, the rest read after it
    ('<tool_call>{"name": "f", "arguments": {"a": "x</tool_call> and more text', "and more text", [("f", '{"a": "x')]),
    ('<tool_call>{"name": "f", "arguments": {"a": "x</tool_call>\n<tool_call>{"name": "g", "arguments": {}}</tool_call>',
     None, [("f", '{"a": "x'), ("g", "{}")]),
    ('<tool_call>{"name": "f", "arguments": {"a": "x</tool_call> said "y</tool_call> then',  # a tag outside strings
     'said "y</tool_call> then', [("f", '{"a": "x')]),
    ('<tool_call>{"arguments": {"a": "x</tool_call> rest', '<tool_call>{"arguments": {"a": "x</tool_call> rest', []),
]


def _run(pieces, **kw):
    """Feed the pieces; returns (streamed content, tool_calls deltas, message)."""
    p = ToolCallParser(**kw)
    content, parts = "", []
    for piece in pieces:
        text, more = p.feed(piece)
        content, parts = content + text, parts + more
    text, more = p.finish()
    return content + text, parts + more, p.message(), p


def _reassemble(parts) -> list[tuple[str, str]]:
    """Stream deltas back into calls, checking OpenAI's order: the header (id, type, name, empty
    arguments) first, then argument pieces of that index."""
    calls: dict[int, list] = {}
    for d in parts:
        if "id" in d:
            assert d["index"] not in calls and d["type"] == "function" and d["id"].startswith("call_"), d
            assert d["function"]["arguments"] == "" and d["function"]["name"], d
            calls[d["index"]] = [d["function"]["name"], ""]
        else:
            assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}, d
            calls[d["index"]][1] += d["function"]["arguments"]
    assert sorted(calls) == list(range(len(calls)))
    return [tuple(calls[i]) for i in range(len(calls))]


def _check(pieces, content, calls, **kw):
    streamed, parts, message, _ = _run(pieces, **{"tags": TAGS, **kw})
    assert message["content"] == content
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])] == calls
    assert _reassemble(parts) == calls
    assert streamed == (content or "")


@pytest.mark.parametrize("answer,content,calls", ANSWERS)
def test_auto_answer_becomes_content_and_tool_calls(answer, content, calls):
    _check([answer], content, calls)
    for name, args in calls:
        if args.endswith("}"):
            json.loads(args)  # complete calls carry their arguments exactly as JSON


@pytest.mark.parametrize("answer,content,calls", ANSWERS)
def test_every_split_of_the_text_streams_the_same_message(answer, content, calls):
    for i in range(len(answer) + 1):
        _check([answer[:i], answer[i:]], content, calls)
    _check(list(answer), content, calls)


def test_arguments_stream_before_the_call_is_closed():
    p = ToolCallParser(tags=TAGS)
    assert p.feed('Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os')[1] == [
        {"index": 0, "id": p.calls[0].id, "type": "function", "function": {"name": "get_weather", "arguments": ""}},
        {"index": 0, "function": {"arguments": '{"city": "Os'}}]
    assert p.feed('lo"}}\n</tool_call>')[1] == [{"index": 0, "function": {"arguments": 'lo"}'}}]
    assert p.made_calls and p.message()["content"] == "Sure."


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    answer = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
              '<tool_call>{"name": "b", "arguments": {}}</tool_call> trailing')
    for pieces in ([answer], list(answer)):
        _, parts, message, _ = _run(pieces, tags=TAGS, parallel=False)
        assert _reassemble(parts) == [("a", "{}")] and message["content"] is None


def test_forced_calls_read_the_whole_answer():
    required = '{"name": "get_weather", "arguments": {"city": "a}b"}}'
    named = '{"city": "Rome"}'
    for i in range(len(required) + 1):
        _, parts, message, _ = _run([required[:i], required[i:]])
        assert _reassemble(parts) == [("get_weather", '{"city": "a}b"}')] and message["content"] is None
    for i in range(len(named) + 1):
        _, parts, message, _ = _run([named[:i], named[i:]], name="get_weather")
        assert _reassemble(parts) == [("get_weather", named)]


@pytest.mark.parametrize("cut", ['{"na', '{"name": "get_wea', '{"name": "get_weather", "argu'])
def test_a_required_call_cut_short_before_its_arguments_is_its_text_as_content(cut):
    """max_tokens ended the answer before the call's name and arguments began: no call, and the
    text the model wrote is not dropped."""
    for pieces in ([cut], list(cut)):
        streamed, parts, message, p = _run(pieces)
        assert parts == [] and not p.made_calls
        assert streamed == cut and message == {"role": "assistant", "content": cut}


def test_a_forced_call_cut_short_in_its_arguments_keeps_the_arguments_written():
    streamed, parts, message, _ = _run(['{"name": "get_weather", "arguments": {"ci'])
    assert streamed == "" and _reassemble(parts) == [("get_weather", '{"ci')] and message["content"] is None
    streamed, parts, message, _ = _run(['{"ci'], name="get_weather")
    assert streamed == "" and _reassemble(parts) == [("get_weather", '{"ci')] and message["content"] is None


# ---- real token streams -------------------------------------------------------------------
QWEN_STYLE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "Call a function as <tool_call>\n{\"name\": <name>, \"arguments\": <args>}\n</tool_call><|im_end|>\n{% endif %}"
    "{%- for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _qwen_style_checkpoint(root: Path, tags_special: bool) -> Path:
    """A byte-level BPE tokenizer with ChatML specials and the call tags as added tokens:
    ordinary ones (as Qwen's tokenizers have them, so decoding keeps them) or special ones."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ['{"name": "get_weather", "arguments": {"city": "Oslo"}} Let me check the weather.'] * 20
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=320, special_tokens=["<unk>", "<|im_start|>",
                                                                                        "<|im_end|>"],
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.add_tokens([AddedToken(t, special=tags_special, normalized=False) for t in TAGS])
    path = root / ("special" if tags_special else "plain")
    path.mkdir()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>", "chat_template": QWEN_STYLE}))
    return path


@pytest.fixture(scope="module")
def qwen_style(tmp_path_factory):
    root = tmp_path_factory.mktemp("tool_tokenizers")
    return {special: _qwen_style_checkpoint(root, special) for special in (False, True)}


def _token_stream_checks(tok, answer: str, content, calls, **kw):
    ids = tok.encode(answer)
    for token_pieces in [[[t] for t in ids], *[[ids[:k], ids[k:]] for k in range(len(ids) + 1)]]:
        stream = TextStream(tok.decode)
        deltas = [stream.feed(piece) for piece in token_pieces] + [stream.finish()]
        assert "".join(deltas) == tok.decode(ids)
        _check(deltas, content, calls, **kw)


ANSWER = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'


def test_qwen_style_token_streams_read_back_the_same_call(qwen_style):
    tok = load_tokenizer(qwen_style[False], 400)
    assert "<tool_call>" in tok.decode(tok.encode(ANSWER))
    assert tok.encode("<tool_call>") == [tok._tok.token_to_id("<tool_call>")]  # one token, as in Qwen's vocabulary
    _token_stream_checks(tok, ANSWER, "Let me check.", [("get_weather", '{"city": "Zürich"}')])


def test_demo_tokenizer_token_streams_read_back_the_same_calls():
    tok = load_tokenizer(DEMO, 264)
    answer = ANSWER + '\n<tool_call>{"name": "f", "arguments": {"é": [1, 2]}}</tool_call>'
    _token_stream_checks(tok, answer, "Let me check.", [("get_weather", '{"city": "Zürich"}'),
                                                        ("f", '{"é": [1, 2]}')])


# ---- the plan: which templates auto works with ---------------------------------------------
def _body(**kw) -> ChatRequest:
    return ChatRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "weather?"}],
                                       "tools": [WEATHER], **kw})


def test_auto_plans_hermes_calls_for_a_qwen_style_checkpoint(qwen_style):
    path = qwen_style[False]
    template, tok = chat_template(path), load_tokenizer(path, 400)
    plan = plan_tools(_body(), template, tok)  # auto is the default with tools
    assert plan.format is not None and plan.format.start == "<tool_call>" and not plan.forced and plan.parses
    prompt = render_chat(template, [{"role": "user", "content": "weather?"}], tools=plan.tools)
    assert '"name": "get_weather"' in prompt and "<tool_call>" in prompt
    assert plan_tools(_body(parallel_tool_calls=False), template, tok).parser().parallel is False


def test_auto_is_a_400_when_the_tokenizer_drops_the_tags(qwen_style):
    path = qwen_style[True]
    with pytest.raises(APIError, match="drops <tool_call> when decoding") as e:
        plan_tools(_body(tool_choice="auto"), chat_template(path), load_tokenizer(path, 400))
    assert e.value.status == 400 and e.value.param == "tool_choice"


def test_family_templates_without_a_call_syntax_keep_the_400():
    from test_chat_templates_families import FAMILIES

    assert tool_format(FAMILIES["qwen3_next"][0]).name == "hermes"
    for family in ("nemotron_h", "granite_moe_hybrid", "falcon_h1", "bamba"):
        assert tool_format(FAMILIES[family][0]) is None
        with pytest.raises(APIError, match="renders tools but writes no tool-call syntax"):
            plan_tools(_body(), FAMILIES[family][0])
    with pytest.raises(APIError, match="has no tool format"):
        plan_tools(_body(), chat_template(DEMO))
    # a template that only mentions the tags without rendering tools has no tool format either
    assert tool_format("{{ messages[0].content }} <tool_call></tool_call>") is None


def test_an_xml_body_between_the_same_tags_is_not_read_as_hermes():
    """Qwen3-Coder style: <tool_call><function=name><parameter=k>v</parameter></function></tool_call>."""
    hermes = QWEN_STYLE
    coder = QWEN_STYLE.replace('{\"name\": <name>, \"arguments\": <args>}', "<function=NAME><parameter=K>V</parameter>"
                                                                           "</function>")
    assert coder != hermes and tool_format(hermes).name == "hermes" and tool_format(coder) is None
    with pytest.raises(APIError, match="writes no tool-call syntax"):
        plan_tools(_body(), coder)


# ---- any text: streamed in any pieces, the same message as whole --------------------------
FRAGMENTS = ["<tool_call>", "</tool_call>", '{"name": "f", "arguments": ', '{"arguments": ', '"name": "g"', "{", "}",
             "[", "]", '"', "\\", ",", " ", "\n", "1", "true", "<", "</tool", "<tool_c", "text", "é", "<TOOLCALL>",
             "</TOOLCALL>", "<TOOL"]


@pytest.mark.parametrize("mode", [{"tags": TAGS}, LISTED], ids=["hermes", "listed"])
def test_any_answer_streams_to_the_same_message_as_whole(mode):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=100, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.lists(st.sampled_from(FRAGMENTS), max_size=16).map("".join),
           st.lists(st.integers(0, 200), max_size=6), st.booleans())
    def check(answer, cuts, parallel):
        _, whole_parts, whole, _ = _run([answer], parallel=parallel, **mode)
        cuts = sorted({min(c, len(answer)) for c in cuts})
        pieces = [answer[a:b] for a, b in zip([0, *cuts], [*cuts, len(answer)])]
        streamed, parts, message, _ = _run(pieces, parallel=parallel, **mode)
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls", [])]
        assert message["content"] == whole["content"] and streamed == (message["content"] or "")
        assert _reassemble(parts) == calls == _reassemble(whole_parts)
        assert calls or message["content"] == answer  # without a call, the text comes back exactly

    check()


# ---- Nemotron-style: each block a JSON array of calls ------------------------------------
LISTED_ANSWERS = [
    ('<TOOLCALL>[{"name": "get_weather", "arguments": {"city": "Oslo"}}, {"name": "f", "arguments": {"a": [1]}}]'
     '</TOOLCALL>', None, [("get_weather", '{"city": "Oslo"}'), ("f", '{"a": [1]}')]),
    ('Checking. <TOOLCALL>[\n  {"name": "f", "arguments": {"s": "],}"}}\n]</TOOLCALL>', "Checking.",
     [("f", '{"s": "],}"}')]),
    ('<TOOLCALL>{"name": "f", "arguments": {}}</TOOLCALL>', None, [("f", "{}")]),  # without the array
    ('<TOOLCALL>[{"name": "f", "arguments": {}}, 42]</TOOLCALL>', None, [("f", "{}")]),  # a stray item dropped
    ("<TOOLCALL>[1, 2]</TOOLCALL> done", "<TOOLCALL>[1, 2]</TOOLCALL> done", []),  # no call: text
    ('<TOOLCALL>[{"name": "f", "arguments": {"x": 1', None, [("f", '{"x": 1')]),  # cut short
    ('<TOOLCALL>[{"name": "f", "arguments": {"s": "]</TOOLCALL>"}}]</TOOLCALL> ok', "ok",
     [("f", '{"s": "]</TOOLCALL>"}')]),  # a closing tag inside a string
    ('<TOOLCALL>[{"name": "f", "arguments": {"s": "x</TOOLCALL> after', "after", [("f", '{"s": "x')]),  # never closed
]


@pytest.mark.parametrize("answer,content,calls", LISTED_ANSWERS)
def test_nemotron_style_blocks_hold_a_list_of_calls(answer, content, calls):
    for i in range(len(answer) + 1):
        _check([answer[:i], answer[i:]], content, calls, **LISTED)
    _check(list(answer), content, calls, **LISTED)


def test_nemotron_style_parallel_false_keeps_the_first_call_of_the_list():
    answer = LISTED_ANSWERS[0][0]
    for pieces in ([answer], list(answer)):
        _, parts, message, _ = _run(pieces, parallel=False, **LISTED)
        assert _reassemble(parts) == [("get_weather", '{"city": "Oslo"}')] and len(message["tool_calls"]) == 1


def test_nemotron_style_template_plans_listed_calls_read_from_demo_token_streams():
    template = QWEN_STYLE.replace("<tool_call>", "<TOOLCALL>[").replace("</tool_call>", "]</TOOLCALL>")
    plan = plan_tools(_body(), template, load_tokenizer(DEMO, 264))
    assert "[{" not in QWEN_STYLE and plan.format.name == "nemotron" and plan.parser().listed
    answer, content, calls = LISTED_ANSWERS[1]
    _token_stream_checks(load_tokenizer(DEMO, 264), answer, content, calls, **LISTED)
