"""`hyrax generate --prompts-file F`: every line it cannot use is a one-line error naming the
file and line (a lone surrogate was a TypeError traceback in the tokenizer, bytes that are not
UTF-8 a UnicodeDecodeError traceback), and a key a line may not hold is refused by name (it was
ignored: `max_tokens` on a line did nothing)."""
from __future__ import annotations

import argparse

import pytest
import torch

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import resolve_model_path
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.tokenizer import load_tokenizer
from hyrax.cluster import cli
from hyrax.cluster.generate import _prompts

DEMO = resolve_model_path("demo")
TOK = load_tokenizer(DEMO, ModelConfig.from_dir(DEMO).vocab_size)


def _from_file(tmp_path, data: bytes, *prompt: str):
    f = tmp_path / "prompts.jsonl"
    f.write_bytes(data)
    return f, _prompts(argparse.Namespace(prompt=list(prompt), prompt_ids=[], prompts_file=str(f)), TOK)


def test_good_lines_become_prompts(tmp_path):
    # U+2028 raw inside a string: JSON text, no line break (str.splitlines broke the line there)
    _, out = _from_file(tmp_path, b'{"prompt": "ab"}\n\n{"prompt_ids": [1, 2, 3]}\n' + '{"prompt": "x\u2028y"}\n'.encode())
    assert out == [TOK.encode("ab"), [1, 2, 3], TOK.encode("x\u2028y")]


@pytest.mark.parametrize("data, line, says", [
    (b'{"prompt": "\\ud800"}\n', 1, 'prompt: not valid Unicode (it holds a lone surrogate)'),
    (b'{"prompt": "a"}\n{"prompt": "\xff\xfe"}\n', 2, "not valid UTF-8"),
    (b'{"prompt": "a", "foo": 1}\n', 1, "unknown key 'foo'"),
    (b'{"prompt": "a", "max_tokens": 5}\n', 1, "unknown key 'max_tokens'"),
    (b'{"prompt": "a", "prompt_ids": [1]}\n', 1, 'a line holds one of "prompt" or "prompt_ids"'),
    (b'{}\n', 1, 'a line holds one of "prompt" or "prompt_ids"'),
    (b'{"prompt": 5}\n', 1, '"prompt" must be a string'),
    (b'{"prompt_ids": [1, "2"]}\n', 1, '"prompt_ids" must be a list of token ids (ints >= 0)'),
    (b'{"prompt_ids": [true]}\n', 1, '"prompt_ids" must be a list of token ids (ints >= 0)'),
    (b'{"prompt_ids": [-1]}\n', 1, '"prompt_ids" must be a list of token ids (ints >= 0)'),
    (b'["a"]\n', 1, 'expected {"prompt": str} or {"prompt_ids": [int]}'),
    (b'{"prompt": \n', 1, "not valid JSON"),
])
def test_a_bad_line_is_an_error_naming_the_file_and_line(tmp_path, data, line, says):
    with pytest.raises(HyraxInputError) as e:
        _from_file(tmp_path, data)
    f = tmp_path / "prompts.jsonl"
    assert str(e.value).startswith(f"{f}:{line}: {says}")


def test_sampling_keys_on_a_line_point_at_the_flags(tmp_path):
    with pytest.raises(HyraxInputError, match="sampling options .* apply to every prompt"):
        _from_file(tmp_path, b'{"prompt": "a", "max_tokens": 5}\n')


def test_a_prompt_flag_that_is_not_text_is_an_error(tmp_path):
    """Bytes on the command line that are not UTF-8 arrive as lone surrogates (surrogateescape)."""
    with pytest.raises(HyraxInputError, match=r"^--prompt: not valid Unicode"):
        _prompts(argparse.Namespace(prompt=["a\udcff"], prompt_ids=[], prompts_file=None), TOK)


def test_the_cli_answers_with_one_line(tmp_path, capsys):
    f = tmp_path / "p.jsonl"
    f.write_bytes(b'{"prompt": "\\ud800"}\n')
    assert cli.main(["generate", "--prompts-file", str(f)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"hyrax: error: {f}:1: prompt: not valid Unicode (it holds a lone surrogate)"]


@pytest.mark.parametrize("flags, named", [(["--cpu-affinity", "off"], "--cpu-affinity off"),
                                          (["--no-compiled-graph"], "--no-compiled-graph")])
def test_ray_only_engine_options_are_an_error_not_ignored(capsys, flags, named):
    """`hyrax generate` runs no rank actors: an option that only they use would change nothing."""
    assert cli.main(["generate", "--prompt", "hi", "--max-tokens", "2", *flags]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"hyrax: error: {named}: applies to a Ray replica's rank actors; hyrax generate runs the engine in-process, "
        "without them"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="hyrax generate runs on the CPU; the check is for no CUDA")
def test_cuda_graphs_on_the_cpu_is_a_one_line_error(capsys):
    """CudaGraphDecode raised a ValueError: a 21-line traceback."""
    assert cli.main(["generate", "--prompt", "hi", "--captured-decode", "cuda_graphs", "--max-tokens", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("hyrax: error: --captured-decode cuda_graphs needs a CUDA device"), err
