"""`hyrax serve --config FILE`: YAML keys are the options' long names, checked and converted as
the flags themselves are (a value set straight as a parser default skips argparse's conversion:
`deterministic: "false"` switched deterministic mode on, `max-running: 3.7` reached the engine
as a float). Explicit flags still win over the file."""
from __future__ import annotations

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster import cli
from hyrax.cluster.engine_args import engine_config_from_args
from hyrax.cluster.serve import apply_yaml


def parse(tmp_path, yaml_text: str, *flags: str):
    path = tmp_path / "serve.yaml"
    path.write_text(yaml_text)
    path.chmod(0o600)  # the operator's own (a file holding api-key must be)
    parser = cli.build_parser()
    argv = ["serve", "--config", str(path), *flags]
    apply_yaml(parser._subparsers._group_actions[0].choices["serve"], argv[1:])
    return parser.parse_args(argv)


def test_values_become_the_engine_config_and_flags_win(tmp_path):
    a = parse(tmp_path, "deterministic: true\nmax-running: 7\nprefix-cache: false\nhost-pool-mb: 12\n",
              "--max-running", "9")
    cfg = engine_config_from_args(a)
    assert (cfg.deterministic, cfg.max_running, cfg.prefix_cache, cfg.host_pool_mb) == (True, 9, False, 12)
    assert type(cfg.max_running) is int


def test_a_gateway_option_takes_effect_spelled_with_dashes_or_underscores_but_not_both(tmp_path):
    """`max-inflight: 5` (the long option's name) reaches the gateway's limit, as does
    `max_inflight` (the same key); both in one file are one key given twice."""
    assert parse(tmp_path, "max-inflight: 5\n").max_inflight == 5
    assert parse(tmp_path, "max_inflight: 6\n").max_inflight == 6
    with pytest.raises(HyraxInputError, match=r"given twice \(lines 1 and 2\)"):
        parse(tmp_path, "max-inflight: 5\nmax_inflight: 6\n")


@pytest.mark.parametrize("text, named", [
    ('deterministic: "false"\n', "deterministic must be true or false"),
    ("no-overlap: 1\n", "no-overlap must be true or false"),
    ("max-running: 3.7\n", "max-running must be an int"),
    ("max-running:\n", "max-running needs one value"),
    ("kv-capacity-tokens: [1, 2]\n", "kv-capacity-tokens needs one value"),
    ("no-such-option: 1\n", "unknown option 'no-such-option'"),
    # a switch's --no- flag as a key: the error names the spelling the file takes
    ("no-prefix-cache: true\n", "unknown option 'no-prefix-cache'; write prefix-cache: false"),
    ("no-prefix-cache: false\n", "unknown option 'no-prefix-cache'; write prefix-cache: true"),
    ("no_compiled_graph: true\n", "unknown option 'no_compiled_graph'; write compiled-graph: false"),
])
def test_a_value_the_flag_would_refuse_is_an_error_naming_it(tmp_path, text, named):
    with pytest.raises(HyraxInputError, match=named):
        parse(tmp_path, text)


@pytest.mark.parametrize("text, says", [
    ("rank-timeout: 0\n", "--config: rank-timeout must be a finite number in (0, 1e+09], got '0'"),
    ("max-body-mb: .nan\n", "--config: max-body-mb must be a finite number > 0, got '.nan'"),  # as written
    ("grace-period: -5\n", "--config: grace-period must be a finite number >= 0, got '-5'"),
    ("decode-replicas: 0\n", "--config: decode-replicas must be an int >= 1, got '0'"),
    ("host-pool-mb: .inf\n", "--config: host-pool-mb must be a finite number >= 0, got '.inf'"),
    ('api-key: ""\n', "--config: api-key must be"),
    ('served-model-name: ""\n', "--config: served-model-name must be"),
])
def test_a_value_out_of_the_flags_range_is_an_error_naming_it(tmp_path, text, says):
    with pytest.raises(HyraxInputError) as e:
        parse(tmp_path, text)
    assert str(e.value).startswith(says)


def test_the_cli_answers_a_bad_file_value_with_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_text('deterministic: "false"\n')
    # a model that does not exist: were the file's value accepted, serve would stop there at once
    assert cli.main(["serve", "--config", str(path), "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hyrax: error: --config: deterministic must be true or false, got 'false'"]


def test_the_prefill_chunk_fits_the_step_budget_unless_given_and_never_exceeds_it(tmp_path):
    """The default chunk (256) shrinks to a smaller budget given alone; an explicit chunk larger
    than a budget given is an error naming both (it was silently cut to the budget); a budget
    left to the device grows to the chunk (test_step_budget_by_device.py)."""
    assert engine_config_from_args(parse(tmp_path, "")).prefill_chunk == 256
    assert engine_config_from_args(parse(tmp_path, "max-batch-tokens: 128\n")).prefill_chunk == 128
    assert engine_config_from_args(parse(tmp_path, "", "--prefill-chunk", "128")).prefill_chunk == 128
    with pytest.raises(HyraxInputError, match=r"prefill-chunk \(1024\) must not exceed max-batch-tokens \(512\)"):
        engine_config_from_args(parse(tmp_path, "max-batch-tokens: 512\n", "--prefill-chunk", "1024"))
    auto = engine_config_from_args(parse(tmp_path, "", "--prefill-chunk", "1024"))
    assert auto.for_device("cpu").max_batch_tokens == 1024


def test_a_config_file_that_is_not_utf8_is_a_one_line_error(tmp_path, capsys):
    path = tmp_path / "serve.yaml"
    path.write_bytes(b"max-running: 4\n\xff\xfe: 1\n")
    assert cli.main(["serve", "--config", str(path), "--model", str(tmp_path / "no-model")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["hyrax: error: --config is not UTF-8 text: byte 0xff at offset 15"]


def test_an_empty_config_path_is_an_error_not_ignored(tmp_path, capsys):
    assert cli.main(["serve", "--config", "", "--model", str(tmp_path / "no-model")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == ["hyrax: error: --config needs a file name, got ''"]
