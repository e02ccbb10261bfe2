"""Tokenizer fidelity with transformers: plain text gets the checkpoint's special tokens (BOS
from the post-processor), a chat prompt is the checkpoint's own template rendered like
`apply_chat_template` (bos_token/eos_token, add_generation_prompt, list-of-parts content) and
tokenized without extra specials, decoding skips special tokens, and generation stops at every
EOS id of config.json and generation_config.json."""
from __future__ import annotations

import json

import pytest

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.tokenizer import chat_template, load_tokenizer
from hyrax.api.text import render_chat

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'system' %}<|system|>\n{% elif m['role'] == 'user' %}<|user|>\n{% else %}<|assistant|>\n{% endif %}"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}"
    "{% for part in m['content'] %}{% if part['type'] == 'text' %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
CONVERSATIONS = [
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hello there, how are you?"}],
    [{"role": "user", "content": "What is two plus two?"}, {"role": "assistant", "content": "Four."},
     {"role": "user", "content": "And three plus three?"}],
    [{"role": "user", "content": [{"type": "text", "text": "Describe "}, {"type": "text", "text": "a hyrax."}]}],
]
SPECIALS = ["<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    corpus = [" ".join(m["content"] if isinstance(m["content"], str) else "x" for m in c) for c in CONVERSATIONS]
    tok.train_from_iterator(corpus * 20, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", *SPECIALS],
                                                             initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                                  unk_token="<unk>")
    hf_tok.chat_template = TEMPLATE
    path = tmp_path_factory.mktemp("tok")
    hf_tok.save_pretrained(path)
    return path, transformers.AutoTokenizer.from_pretrained(path)


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)), ids=["system", "multi_turn", "list_of_parts"])
def test_chat_prompt_equals_apply_chat_template_token_for_token(model_dir, conv):
    path, ref_tok = model_dir
    msgs = CONVERSATIONS[conv]
    ref = ref_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    tok = load_tokenizer(path, ref_tok.vocab_size)
    got = tok.encode(render_chat(chat_template(path), msgs))
    assert got == list(ref)
    assert got.count(ref_tok.bos_token_id) == 1  # the template's BOS, not a second one


def test_plain_text_gets_bos_like_transformers_and_decoding_skips_specials(model_dir):
    path, ref_tok = model_dir
    tok = load_tokenizer(path, ref_tok.vocab_size)
    text = "Hello there, how are you?"
    assert tok.encode(text) == ref_tok(text)["input_ids"]
    assert tok.encode(text)[0] == ref_tok.bos_token_id
    ids = tok.encode(text) + [ref_tok.eos_token_id]
    assert tok.decode(ids) == ref_tok.decode(ids, skip_special_tokens=True)


def test_generation_config_eos_ids_join_the_config_eos(tmp_path):
    from tiny_models import tiny_config

    (tmp_path / "config.json").write_text(json.dumps(tiny_config("full", eos_token_id=(2,)).to_hf_dict()))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7, 9]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_id == (2, 7, 9)


def test_encoding_a_long_text_lets_other_threads_run_and_gives_the_same_ids():
    """The gateway tokenizes a long prompt on a worker thread so that its event loop goes on
    serving others; that helps only if encoding lets go of the GIL (tokenizers' `encode` holds
    it throughout: a 4 MB prompt stopped every other thread of the gateway for ~4 s). A ticker
    thread must get to run while a ~0.5 s encoding is under way."""
    import threading
    import time
    from pathlib import Path

    from tokenizers import Tokenizer

    path = Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo" / "tokenizer.json"
    tok, text = load_tokenizer(path.parent, 264), "hello world, this is some text. " * 16_000
    ticks, stop = [], threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            time.sleep(0.001)

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    while not ticks:
        time.sleep(0.001)
    before = len(ticks)
    ids = tok.encode(text)
    during = len(ticks) - before
    stop.set()
    ticker.join()
    assert during >= 10, f"the ticker ran {during} times while the text was encoded"
    assert ids == Tokenizer.from_file(str(path)).encode(text).ids
