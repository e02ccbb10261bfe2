"""Chat prompts for every supported family equal transformers' `apply_chat_template(...,
add_generation_prompt=True, tokenize=True)` token for token.

No real checkpoint can be fetched here, so each family gets a template written for this test in
the style of that family's own (role tokens, default system prompt, tool block, reasoning
switches) and using the Jinja features the real ones lean on: `namespace`, macros, `loop.*`,
slicing and string methods, `raise_exception`, `tojson`, `strftime_now`, `tools`, and
whitespace that only comes out right under trim_blocks/lstrip_blocks. Each is saved with a
tokenizer whose special tokens are the template's role tokens, as `save_pretrained` writes it,
and read back by Hyrax (`chat_template` + `load_tokenizer`) and by `AutoTokenizer`."""
from __future__ import annotations

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.tokenizer import chat_template, load_tokenizer
from hyrax.api.text import render_chat

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

# A macro shared by the templates below: a message's content as a string, or its text parts.
_CONTENT = (
    "{%- macro text_of(c) -%}"
    "{%- if c is string -%}{{ c }}"
    "{%- elif c is iterable -%}{%- for p in c if p['type'] == 'text' -%}{{ p['text'] }}{%- endfor -%}"
    "{%- else -%}{{ c }}"  # anything else as Jinja prints it: a missing key as '', None as 'None'
    "{%- endif -%}"
    "{%- endmacro -%}\n"
)

# NemotronH style: <SPECIAL_1x> role tokens, a system turn always present, `/think` and
# `/no_think` switches read from the system message through a namespace, an empty think block
# opened in the generation prompt when reasoning is off.
NEMOTRON_H = _CONTENT + r"""
{%- set ns = namespace(system='', reasoning=true) -%}
{%- if messages[0]['role'] == 'system' -%}
    {%- set ns.system = text_of(messages[0]['content']) -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- if '/no_think' in ns.system -%}{%- set ns.reasoning = false -%}{%- endif -%}
{%- set ns.system = ns.system.replace('/no_think', '').replace('/think', '').strip() -%}
<SPECIAL_10>System
{{ ns.system }}
{%- if tools %}

You can call these functions:
{% for t in tools %}
{{ t | tojson }}
{% endfor %}
{%- endif %}

{% for m in turns -%}
    {%- if m['role'] == 'user' -%}
<SPECIAL_11>User
{{ text_of(m['content']) | trim }}
{% elif m['role'] == 'assistant' -%}
<SPECIAL_11>Assistant
{{ text_of(m['content']).split('</think>')[-1].lstrip() }}<SPECIAL_12>
{% else -%}
    {{ raise_exception('NemotronH template: unexpected role ' ~ m['role']) }}
    {%- endif -%}
{%- endfor -%}
{%- if add_generation_prompt -%}
<SPECIAL_11>Assistant
{% if not ns.reasoning %}<think></think>{% else %}<think>
{% endif %}
{%- endif -%}
"""

# Granite 4.0-H style: <|start_of_role|>/<|end_of_role|>/<|end_of_text|>, a default system prompt
# carrying today's date (strftime_now), tools listed in the system turn, unknown roles refused.
GRANITE = _CONTENT + r"""
{%- set ns = namespace(system='') %}
{%- if messages[0]['role'] == 'system' %}
    {%- set ns.system = text_of(messages[0]['content']) %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set ns.system = 'Knowledge cutoff: unknown. Today is ' ~ strftime_now('%B %d, %Y') ~ '. You are a careful assistant.' %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
    {#- a plain `set` inside the loop would not outlive it: the namespace carries the text out #}
    {%- set ns.system = ns.system ~ '\nTools you may call, one JSON object each:\n<tools>' %}
    {%- for tool in tools %}
        {%- set ns.system = ns.system ~ '\n' ~ (tool | tojson) %}
    {%- endfor %}
    {%- set ns.system = ns.system ~ '\n</tools>' %}
{%- endif %}
{{- '<|start_of_role|>system<|end_of_role|>' ~ ns.system ~ '<|end_of_text|>\n' }}
{%- for message in loop_messages %}
    {%- if message['role'] not in ['user', 'assistant', 'tool'] %}
        {{- raise_exception('Granite template: role must be user, assistant or tool, got ' ~ message['role']) }}
    {%- endif %}
    {{- '<|start_of_role|>' ~ message['role'] ~ '<|end_of_role|>' ~ text_of(message['content']) ~ '<|end_of_text|>\n' }}
    {%- if loop.last and add_generation_prompt %}
        {{- '<|start_of_role|>assistant<|end_of_role|>' }}
    {%- endif %}
{%- endfor %}
"""

# Falcon-H1 style: BOS first, ChatML-like turns, and plain `{% %}` tags whose layout relies on
# trim_blocks/lstrip_blocks (indented tags, a newline after each block tag); `tools is not none`
# is only right when `tools` is defined as None without tools.
FALCON_H1 = _CONTENT + r"""{{ bos_token }}
{% if tools is not none %}
<|im_start|>system
{% if messages[0]['role'] == 'system' %}
{{ text_of(messages[0]['content']) }}

{% endif %}
Functions available:
{% for tool in tools %}
    - {{ tool['function']['name'] }}: {{ tool['function'] | tojson(indent=2) }}
{% endfor %}
<|im_end|>
{% endif %}
{% for message in messages %}
    {% if message['role'] == 'system' and tools is not none %}
    {% else %}
<|im_start|>{{ message['role'] }}
{{ text_of(message['content']) }}<|im_end|>
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}
"""

# Qwen3-Next style: ChatML, tools in <tools></tools>, a namespace searched over the reversed
# conversation for the last real user query, earlier assistant turns lose their <think> block,
# reasoning_content and tool calls rendered, a misplaced system message refused.
QWEN3_NEXT = _CONTENT + r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- text_of(messages[0].content) + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions.\n\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nAnswer a call with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + text_of(messages[0].content) + '<|im_end|>\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if message.role == 'user' and not text_of(message.content).startswith('<tool_response>') %}
        {%- set ns.last_query_index = index %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = text_of(message.content) %}
    {%- if message.role == 'system' %}
        {%- if not loop.first %}
            {{- raise_exception('Qwen3-Next template: the system message must come first') }}
        {%- endif %}
    {%- elif message.role == 'user' %}
        {{- '<|im_start|>user\n' + content + '<|im_end|>\n' }}
    {%- elif message.role == 'assistant' %}
        {%- set reasoning = message.reasoning_content if message.reasoning_content is string else '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- '<|im_start|>assistant\n<think>\n' + reasoning + '\n</think>\n\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or not loop.first %}{{- '\n' }}{%- endif %}
                {%- set call = tool_call.function if tool_call.function else tool_call %}
                {{- '<tool_call>\n{"name": "' + call.name + '", "arguments": ' }}
                {{- call.arguments if call.arguments is string else call.arguments | tojson }}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\n<tool_response>\n' + content + '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"""

# Bamba style: role tags built from the role name, EOS closing every assistant turn, BOS on the
# first message only, a system message folded into the first user turn.
BAMBA = _CONTENT + r"""
{%- if messages[0]['role'] == 'system' -%}
    {%- set preamble = text_of(messages[0]['content']) ~ '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set preamble = '' -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for m in loop_messages -%}
    {%- if loop.first -%}{{ bos_token }}{%- endif -%}
    {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception('Bamba template: roles must alternate user/assistant') }}
    {%- endif -%}
    {{ '<|' ~ m['role'] ~ '|>\n' }}
    {%- if loop.first and m['role'] == 'user' %}{{ preamble }}{% endif -%}
    {{ text_of(m['content']) | trim }}
    {%- if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}
{{ '' }}
{%- endfor -%}
{%- if tools -%}
<|tools|>
{{ tools | map(attribute='function') | map(attribute='name') | join(', ') }}
{% endif -%}
{%- if add_generation_prompt %}<|assistant|>
{% endif -%}
"""

FAMILIES = {
    # template, bos, eos, extra special tokens (the role tokens the template writes)
    "nemotron_h": (NEMOTRON_H, "<s>", "<SPECIAL_12>", ["<SPECIAL_10>", "<SPECIAL_11>", "<think>", "</think>"]),
    "granite_moe_hybrid": (GRANITE, "<|end_of_text|>", "<|end_of_text|>",
                           ["<|start_of_role|>", "<|end_of_role|>"]),
    "falcon_h1": (FALCON_H1, "<|begin_of_text|>", "<|im_end|>", ["<|im_start|>"]),
    "qwen3_next": (QWEN3_NEXT, None, "<|im_end|>", ["<|im_start|>", "<think>", "</think>", "<tool_call>",
                                                    "</tool_call>", "<tool_response>", "</tool_response>"]),
    "bamba": (BAMBA, "<|bos|>", "<|eos|>", ["<|user|>", "<|assistant|>", "<|tools|>"]),
}

CONVERSATIONS = {
    "system": [{"role": "system", "content": "You are terse. /no_think"},
               {"role": "user", "content": "  Hello there, how are you?  "}],
    "multi_turn": [{"role": "user", "content": "What is two plus two?"},
                   {"role": "assistant", "content": "<think>\nSmall sums.\n</think>\n\nFour."},
                   {"role": "user", "content": "And three plus three?"}],
    "list_of_parts": [{"role": "user", "content": [{"type": "text", "text": "Describe "},
                                                   {"type": "image_url", "image_url": {"url": "x"}},
                                                   {"type": "text", "text": "a hyrax."}]}],
}
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city, in degrees \u00b0C",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


def _build(root, family):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    template, bos, eos, extra = FAMILIES[family]
    specials = list(dict.fromkeys(["<unk>", *(t for t in (bos, eos) if t), *extra]))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["Hello there, how are you? What is two plus two? Describe a hyrax. weather city function"]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:  # plain text gets BOS from the post-processor; chat prompts must not get a second one
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A",
                                                           special_tokens=[(bos, tok.token_to_id(bos))])
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=bos, eos_token=eos,
                                                  unk_token="<unk>", pad_token=eos)
    hf_tok.chat_template = template
    path = root / family
    hf_tok.save_pretrained(path)
    return path, transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat_templates")
    return {f: _build(root, f) for f in FAMILIES}


def _reference(ref_tok, msgs, **kw):
    out = ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, **kw)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def _hyrax(path, ref_tok, msgs, **kw):
    return load_tokenizer(path, ref_tok.vocab_size).encode(render_chat(chat_template(path), msgs, **kw))


@pytest.mark.parametrize("conv", list(CONVERSATIONS))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_chat_prompt_equals_apply_chat_template(checkpoints, family, conv):
    path, ref_tok = checkpoints[family]
    msgs = CONVERSATIONS[conv]
    ref = _reference(ref_tok, msgs)
    got = _hyrax(path, ref_tok, msgs)
    assert got == ref, (ref_tok.decode(ref), ref_tok.decode(got))
    specials = {i for i, t in ref_tok.added_tokens_decoder.items() if t.special and t.content != "<unk>"}
    assert any(t in specials for t in got)  # role tokens came out as single special tokens
    assert "hyrax" not in conv or "Describe a hyrax." in ref_tok.decode(got)  # parts were rendered
    if ref_tok.bos_token_id is not None and ref_tok.bos_token != ref_tok.eos_token:
        assert got.count(ref_tok.bos_token_id) <= 1


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tools_reach_the_template(checkpoints, family):
    path, ref_tok = checkpoints[family]
    msgs = CONVERSATIONS["system"]
    ref = _reference(ref_tok, msgs, tools=TOOLS)
    got = _hyrax(path, ref_tok, msgs, tools=TOOLS)
    assert got == ref, (ref_tok.decode(ref), ref_tok.decode(got))
    assert "get_weather" in ref_tok.decode(got)
    assert got != _hyrax(path, ref_tok, msgs)


def test_tool_call_turns_with_null_content_render_like_transformers(checkpoints):
    """An OpenAI client sends `content: null` with tool calls; transformers drops None-valued keys
    before rendering, so a template never prints "None"."""
    path, ref_tok = checkpoints["qwen3_next"]
    msgs = [{"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "reasoning_content": None,
             "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "21 C"}]
    ref = _reference(ref_tok, msgs, tools=TOOLS)
    got = _hyrax(path, ref_tok, msgs, tools=TOOLS)
    assert got == ref, (ref_tok.decode(ref), ref_tok.decode(got))
    assert "None" not in ref_tok.decode(got)
    assert msgs[1]["content"] is None  # the caller's messages are left alone


@pytest.mark.parametrize("family,msgs", [
    ("nemotron_h", [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]),
    ("granite_moe_hybrid", [{"role": "narrator", "content": "hi"}]),
    ("qwen3_next", [{"role": "user", "content": "hi"}, {"role": "system", "content": "late"}]),
    ("bamba", [{"role": "user", "content": "hi"}, {"role": "user", "content": "again"}]),
])
def test_raise_exception_is_a_clear_input_error(checkpoints, family, msgs):
    path, ref_tok = checkpoints[family]
    with pytest.raises(Exception):  # noqa: B017 - transformers raises jinja2's TemplateError
        _reference(ref_tok, msgs)
    with pytest.raises(HyraxInputError, match=r"^chat template: .*template: ") as e:
        render_chat(chat_template(path), msgs)
    assert "\n" not in str(e.value)


def test_special_tokens_other_than_bos_eos_are_template_variables(checkpoints):
    """transformers renders with every named special token (pad, unk, ...) and leaves undefined
    the ones the tokenizer lacks."""
    path, ref_tok = checkpoints["qwen3_next"]  # no bos_token
    template = chat_template(path)
    probe = ("{{ pad_token }}|{{ unk_token }}|{{ bos_token is defined }}|{{ tools is none }}|"
             "{{ documents is none }}")
    rendered = render_chat(type(template)(probe, **template.special_tokens), [{"role": "user", "content": "x"}])
    ref = ref_tok.apply_chat_template([{"role": "user", "content": "x"}], chat_template=probe, tokenize=False)
    assert rendered == ref == "<|im_end|>|<unk>|False|True|True"
    import pickle  # the template crosses Ray's object store with its tokens

    back = pickle.loads(pickle.dumps(template))
    assert (str(back), back.special_tokens, back.tool_use, back.eos_token) == \
        (str(template), template.special_tokens, None, "<|im_end|>")


def test_namespace_refuses_underscore_attributes_like_transformers(checkpoints):
    path, ref_tok = checkpoints["qwen3_next"]
    msgs = [{"role": "user", "content": "x"}]
    for probe in ("{% set ns = namespace(_hidden=1) %}{{ ns._hidden }}",
                  "{% set ns = namespace() %}{% set ns._hidden = 1 %}{{ ns._hidden }}"):
        with pytest.raises(Exception, match="underscore"):
            ref_tok.apply_chat_template(msgs, chat_template=probe, tokenize=False)
        with pytest.raises(Exception, match="underscore"):
            render_chat(probe, msgs)
    ok = "{% set ns = namespace(n=dict(a=1)) %}{% set ns.n = dict.fromkeys(['b'], 2) %}{{ ns.n | tojson }}"
    assert render_chat(ok, msgs) == ref_tok.apply_chat_template(msgs, chat_template=ok, tokenize=False) == '{"b": 2}'


def test_named_templates_pick_tool_use_when_tools_are_given(tmp_path):
    """tokenizer_config.json may hold several named templates: transformers renders "tool_use"
    when tools are given and there is one, else "default"."""
    import json

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<|bos|>", "eos_token": "<|eos|>",
        "chat_template": [{"name": "default", "template": "plain"},
                          {"name": "tool_use", "template": "{{ tools | length }} tools"}]}))
    msgs = [{"role": "user", "content": "x"}]
    assert render_chat(chat_template(tmp_path), msgs) == "plain"
    assert render_chat(chat_template(tmp_path), msgs, tools=TOOLS) == "1 tools"
    import pickle

    assert render_chat(pickle.loads(pickle.dumps(chat_template(tmp_path))), msgs, tools=TOOLS) == "1 tools"


def test_a_templates_own_refusal_reaches_the_client_and_other_errors_only_by_kind():
    from hyrax.actors.model.errors import HyraxInputError
    from hyrax.api.text import template_error

    refusing = "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first turn must be the user') }}{% endif %}"
    with pytest.raises(HyraxInputError) as err:
        render_chat(refusing, [{"role": "assistant", "content": "hi"}])
    assert template_error(err.value) == "cannot apply the chat template: first turn must be the user"
    assert template_error(TypeError("secret internals")) == "cannot apply the chat template: TypeError"
