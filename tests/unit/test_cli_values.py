"""Every numeric option of every `hyrax` command is range-checked when it is parsed, on the
command line and in `hyrax serve --config` alike: NaN, infinities, zero or negative values
where they mean nothing are an error naming the option and the value. They were accepted, and
failed later (`int(nan)`), or started a server that hung every request (`--rank-timeout 0`) or
answered every POST 413 (`--max-body-mb 0`); a zero replica count became 1."""
from __future__ import annotations

import pytest

from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import resolve_model_path
from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster import cli
from hyrax.cluster.serve import roles_from_args

REFUSED = [
    # serve: gateway, placement, supervision
    ("serve", "--rank-timeout", "0"), ("serve", "--rank-timeout", "-1"), ("serve", "--rank-timeout", "nan"),
    ("serve", "--max-body-mb", "nan"), ("serve", "--max-body-mb", "-1"), ("serve", "--max-body-mb", "0"),
    ("serve", "--max-body-mb", "inf"),
    ("serve", "--grace-period", "nan"), ("serve", "--grace-period", "-5"), ("serve", "--grace-period", "inf"),
    ("serve", "--gateway-lease", "nan"), ("serve", "--gateway-lease", "0"),
    ("serve", "--placement-wait", "nan"), ("serve", "--placement-wait", "-1"),
    ("serve", "--hung-replica-timeout", "nan"), ("serve", "--hung-replica-timeout", "inf"),
    ("serve", "--num-cpus", "0"), ("serve", "--max-inflight", "0"),
    # serve: an empty served name silently became the default one
    ("serve", "--served-model-name", ""),
    # an empty file name or address silently meant the default one (a local Ray cluster: undeploy started
    # one only to find no deployment there)
    ("serve", "--admin-token-file", ""), ("serve", "--address", ""), ("undeploy", "--address", ""),
    ("admin", "--token-file", ""),
    # serve: deployment shape (0 replicas silently became 1)
    ("serve", "--decode-replicas", "0"), ("serve", "--prefill-replicas", "0"), ("serve", "--prefill-tp", "0"),
    ("serve", "--decode-tp", "-1"), ("serve", "--replicas", "0"), ("serve", "--tp", "0"),
    # engine options (serve and generate)
    ("serve", "--host-pool-mb", "nan"), ("serve", "--host-pool-mb", "-1"), ("generate", "--host-pool-mb", "inf"),
    ("serve", "--page-size", "0"), ("serve", "--kv-capacity-tokens", "0"), ("serve", "--swa-capacity-tokens", "0"),
    ("serve", "--swa-capacity-tokens", "-4"), ("serve", "--mamba-slots", "0"), ("serve", "--max-running", "0"),
    ("serve", "--max-batch-tokens", "-1"), ("serve", "--prefill-chunk", "0"),
    ("serve", "--forced-retraction-interval", "-1"), ("serve", "--mamba-track-interval", "0"),
    ("serve", "--mamba-checkpoint-slots", "-1"),
    # generate's sampling options
    ("generate", "--max-tokens", "0"), ("generate", "--temperature", "nan"), ("generate", "--temperature", "-1"),
    ("generate", "--temperature", "inf"), ("generate", "--top-p", "0"), ("generate", "--top-p", "nan"),
    ("generate", "--top-p", "1.5"), ("generate", "--top-k", "-1"),
    ("generate", "--seed", str(2**63)), ("generate", "--seed", str(-2**63 - 1)), ("generate", "--seed", "1.5"),
    # generate's token ids: an empty item was dropped (`1,,2` ran [1, 2]), an empty list ran an empty prompt
    ("generate", "--prompt-ids", "1,,2"), ("generate", "--prompt-ids", "1,2,"), ("generate", "--prompt-ids", ""),
    ("generate", "--prompt-ids", "1,-2"), ("generate", "--prompt-ids", "1;2"),
    # eval, train-demo, admin
    ("eval", "--limit", "0"), ("eval", "--concurrency", "-2"),
    ("train-demo", "--steps", "0"), ("train-demo", "--batch-size", "0"), ("train-demo", "--threads", "0"),
    ("train-demo", "--lr", "inf"), ("train-demo", "--lr", "nan"), ("train-demo", "--lr", "0"),
    ("train-demo", "--eval-n", "-1"),
    ("admin retract", "--count", "0"), ("admin retract", "--count", "-3"),
]


@pytest.mark.parametrize("command, flag, value", REFUSED)
def test_an_out_of_range_value_is_refused_naming_the_option_and_value(command, flag, value, capsys):
    with pytest.raises(SystemExit) as e:
        cli.build_parser().parse_args([*command.split(), f"{flag}={value}"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert f"argument {flag}: must be" in err.splitlines()[-1] and repr(value) in err.splitlines()[-1]


def test_a_negative_forced_retraction_interval_is_refused(capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["admin", "forced-retraction", "--", "-1"])
    assert "argument interval: must be an int >= 0, got '-1'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["serve", "--grace-period", "0", "--placement-wait", "0", "--host-pool-mb", "0", "--cache-route-margin", "-1",
     "--forced-retraction-interval", "0", "--mamba-checkpoint-slots", "0"],
    ["generate", "--temperature", "0", "--top-p", "1", "--top-k", "0", "--seed", "-7"],
    ["generate", "--seed", str(2**63 - 1)], ["generate", f"--seed={-2**63}"],
    ["train-demo", "--eval-n", "0", "--lr", "1e-3"],
    ["admin", "forced-retraction", "0"],
])
def test_the_boundaries_that_mean_something_are_accepted(argv):
    cli.build_parser().parse_args(argv)


def test_prompt_ids_are_read_as_lists_of_token_ids():
    a = cli.build_parser().parse_args(["generate", "--prompt-ids", "0,1, 2", "--prompt-ids", "7"])
    assert a.prompt_ids == [[0, 1, 2], [7]]


def _roles(*flags: str):
    return roles_from_args(cli.build_parser().parse_args(["serve", *flags]),
                           ModelConfig.from_dir(resolve_model_path("demo")))


@pytest.mark.parametrize("flags", [("--tp", "2"), ("--replicas", "2"), ("--tp", "1")])
def test_colocated_shape_flags_without_colocated_are_an_error(flags):
    with pytest.raises(HyraxInputError, match=f"^{flags[0]}.*: only with --colocated"):
        _roles(*flags)


def test_the_deployment_shape_defaults():
    assert [(r.name, r.replicas, r.tp) for r in _roles()] == [("prefill", 1, 1), ("decode", 1, 1)]
    assert [(r.name, r.replicas, r.tp) for r in _roles("--colocated")] == [("colocated", 1, 1)]
    assert [(r.name, r.replicas) for r in _roles("--colocated", "--replicas", "3")] == [("colocated", 3)]
    assert [(r.name, r.replicas) for r in _roles("--decode-replicas", "2")] == [("prefill", 1), ("decode", 2)]


@pytest.mark.parametrize("key", ["", " ", " padded", "padded ", "tab\there", "caf\u00e9"])
def test_an_api_key_that_no_client_can_send_is_refused_without_echoing_it(key, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--api-key", key])
    last = capsys.readouterr().err.splitlines()[-1]
    assert "argument --api-key: must be" in last
    assert not key.strip() or key not in last


def test_a_body_limit_under_one_byte_is_refused():
    """`int(mb * 2**20)` bytes: 0 would answer every POST 413."""
    from hyrax.cluster.serve import validate

    with pytest.raises(HyraxInputError, match="--max-body-mb 1e-09 is less than one byte"):
        validate(cli.build_parser().parse_args(["serve", "--max-body-mb", "1e-9"]))


@pytest.mark.parametrize("value", ["nan", "inf", "0", "1.5"])
def test_the_gpu_memory_fraction_is_refused_by_the_engine_config(value):
    """Checked by EngineConfig (0 < F <= 1 is false for NaN), as before."""
    from hyrax.cluster.engine_args import engine_config_from_args

    with pytest.raises(HyraxInputError, match=f"gpu-memory-fraction must be in \\(0, 1\\], got {value}"):
        engine_config_from_args(cli.build_parser().parse_args(["serve", "--gpu-memory-fraction", value]))


def test_an_api_key_with_a_space_inside_is_accepted():
    """The gateway strips the header's value, so only a space at either end could never match
    (tests/k8s renders a placeholder key with spaces inside)."""
    assert cli.build_parser().parse_args(["serve", "--api-key", "a b"]).api_key == ["a b"]


@pytest.mark.parametrize("argv", [["serve", "--rank-timeout", "0"], ["serve", "--no-such-flag"],
                                  ["admin", "retract", "--count", "x"], ["nonsense"]])
def test_a_usage_error_is_one_line_and_exit_code_2(argv, capsys):
    """The project's CLI errors are one line: argparse printed its usage block first."""
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert err.startswith("hyrax") and "error:" in err and "--help" in err, err


def test_an_empty_served_model_name_is_a_one_line_error(capsys, monkeypatch):
    """It was silently replaced by the default name; now argument parsing refuses it."""
    from hyrax.cluster import serve

    monkeypatch.setattr(serve, "validate", lambda a: pytest.fail("serve started with an empty served name"))
    assert cli.main(["serve", "--served-model-name", ""]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hyrax serve: error: argument --served-model-name: must be") and err.count("\n") == 1, err


def test_a_config_flag_without_its_file_is_one_line_naming_serve(capsys):
    """`hyrax serve --config` (no file) printed `usage: hyrax [--config CONFIG]` and the error."""
    assert cli.main(["serve", "--config"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "hyrax serve: error: argument --config: expected one argument (see hyrax serve --help)", err
