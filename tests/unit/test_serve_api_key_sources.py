"""`hyrax serve`'s API keys without the key on the command line, where `ps` shows it until Ray
starts: HYRAX_API_KEY (as vLLM's VLLM_API_KEY), or --api-key-file holding one key a line, a
file of this user's that nobody else can read. --api-key still works; two ways at once is a
one-line error naming both, and no error shows a key."""
from __future__ import annotations

import os

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster import cli
from hyrax.cluster.api_keys import resolve_api_keys
from hyrax.cluster.serve import apply_yaml
from test_serve_config_file import parse as parse_with_config


def parse(*argv: str):
    return cli.build_parser().parse_args(["serve", *argv])


def key_file(tmp_path, text: str, mode: int = 0o600):
    f = tmp_path / "api_keys"
    f.write_text(text)
    f.chmod(mode)
    return f


@pytest.fixture(autouse=True)
def no_key_in_the_environment(monkeypatch):
    monkeypatch.delenv("HYRAX_API_KEY", raising=False)


def test_the_environment_variable_gives_the_key(monkeypatch):
    monkeypatch.setenv("HYRAX_API_KEY", "sk-from-env")
    assert resolve_api_keys(parse()) == ("sk-from-env",)


def test_a_key_file_gives_one_key_a_line(tmp_path):
    assert resolve_api_keys(parse("--api-key-file", str(key_file(tmp_path, "sk-one\nsk-two\n")))) == ("sk-one", "sk-two")
    assert resolve_api_keys(parse("--api-key-file", str(key_file(tmp_path, "sk-crlf\r\n")))) == ("sk-crlf",)


def test_api_key_flags_and_no_key_at_all_work_as_before():
    assert resolve_api_keys(parse("--api-key", "a", "--api-key", "b")) == ("a", "b")
    assert resolve_api_keys(parse()) == ()


def test_a_key_file_can_come_from_the_config_file(tmp_path):
    keys = key_file(tmp_path, "sk-from-file\n")
    assert resolve_api_keys(parse_with_config(tmp_path, f"api-key-file: {keys}\n")) == ("sk-from-file",)


@pytest.mark.parametrize("ways", [("--api-key", "HYRAX_API_KEY"), ("--api-key", "--api-key-file"),
                                  ("HYRAX_API_KEY", "--api-key-file")])
def test_two_ways_at_once_is_an_error_naming_both(tmp_path, monkeypatch, ways):
    """Which would win, or would they add up? Neither guess is safe for a credential."""
    argv = []
    if "--api-key" in ways:
        argv += ["--api-key", "sk-flag-secret"]
    if "--api-key-file" in ways:
        argv += ["--api-key-file", str(key_file(tmp_path, "sk-file-secret\n"))]
    if "HYRAX_API_KEY" in ways:
        monkeypatch.setenv("HYRAX_API_KEY", "sk-env-secret")
    with pytest.raises(HyraxInputError) as e:
        resolve_api_keys(parse(*argv))
    msg = str(e.value)
    assert all(w in msg for w in ways) and "secret" not in msg and "\n" not in msg, msg


def test_keys_of_the_config_file_and_the_variable_are_two_ways_too(tmp_path, monkeypatch):
    monkeypatch.setenv("HYRAX_API_KEY", "sk-env-secret")
    with pytest.raises(HyraxInputError, match=r"--api-key \(or api-key in --config\) and HYRAX_API_KEY"):
        resolve_api_keys(parse_with_config(tmp_path, "api-key: sk-config-secret\n"))  # no --api-key flag given


@pytest.mark.parametrize("value, says", [
    ("", "HYRAX_API_KEY is set but empty"),
    (" sk-padded-secret", "HYRAX_API_KEY must be printable ASCII"),
    ("sk-\x01-secret", "HYRAX_API_KEY must be printable ASCII"),
])
def test_an_unusable_variable_is_refused_without_showing_it(monkeypatch, value, says):
    """An empty one (an exported unset variable, an empty Secret) would otherwise serve /v1 open."""
    monkeypatch.setenv("HYRAX_API_KEY", value)
    with pytest.raises(HyraxInputError) as e:
        resolve_api_keys(parse())
    assert str(e.value).startswith(says) and "secret" not in str(e.value), str(e.value)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o620, 0o644])
def test_a_key_file_others_can_read_or_write_is_refused(tmp_path, mode):
    f = key_file(tmp_path, "sk-secret\n", mode)
    with pytest.raises(HyraxInputError, match=f"^--api-key-file {f} can be read or written by other users "
                                              f"\\(mode {mode:o}\\): chmod 600 it$"):
        resolve_api_keys(parse("--api-key-file", str(f)))
    key_file(tmp_path, "sk-secret\n", 0o400)
    assert resolve_api_keys(parse("--api-key-file", str(f))) == ("sk-secret",)  # read-only for its owner: fine


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a file to another user needs root")
def test_a_key_file_of_another_user_is_refused(tmp_path):
    f = key_file(tmp_path, "sk-secret\n")
    os.chown(f, 65534, 65534)
    with pytest.raises(HyraxInputError, match="belongs to another user \\(uid 65534\\)"):
        resolve_api_keys(parse("--api-key-file", str(f)))


@pytest.mark.parametrize("text, says", [
    ("", "holds no key"),
    ("\n", "line 1 is empty"),
    ("sk-one\n\nsk-two\n", "line 2 is empty"),
    ("sk-one\nsk two secret \n", "line 2 is not a key (printable ASCII, no space at either end)"),
    ("sk-\u00e9-secret\n", "line 1 is not a key (printable ASCII, no space at either end)"),
])
def test_a_malformed_key_file_is_refused_by_line_without_showing_it(tmp_path, text, says):
    f = key_file(tmp_path, text)
    with pytest.raises(HyraxInputError) as e:
        resolve_api_keys(parse("--api-key-file", str(f)))
    assert str(e.value) == f"--api-key-file {f} {says}", str(e.value)


def test_a_key_file_that_is_no_regular_file_is_refused(tmp_path):
    with pytest.raises(HyraxInputError, match="is not a regular file"):
        resolve_api_keys(parse("--api-key-file", str(tmp_path)))
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo, 0o600)  # opened for reading, it would wait for a writer forever
    with pytest.raises(HyraxInputError, match="is not a regular file"):
        resolve_api_keys(parse("--api-key-file", str(fifo)))


def test_a_huge_key_file_is_refused_unread(tmp_path):
    f = key_file(tmp_path, "k" * (1 << 20))
    with pytest.raises(HyraxInputError, match="is larger than 64 KiB: not a key file"):
        resolve_api_keys(parse("--api-key-file", str(f)))


def test_hyrax_serve_answers_a_missing_key_file_in_one_line(tmp_path, capsys):
    assert cli.main(["serve", "--colocated", "--api-key-file", str(tmp_path / "nope")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hyrax: error: cannot read --api-key-file {tmp_path / 'nope'}: No such file or directory"]


def test_an_abbreviated_api_key_flag_is_refused_as_ambiguous(capsys):
    """--api-k was --api-key; beside --api-key-file it could be either."""
    with pytest.raises(SystemExit):
        parse("--api-k", "sk-secret")
    assert "ambiguous option: --api-k" in capsys.readouterr().err


def test_a_config_file_holding_keys_that_others_can_read_is_refused(tmp_path):
    """--api-key-file refuses a file other users can read or write; the same keys in a --config
    file with the same mode were accepted."""
    path = tmp_path / "serve.yaml"
    path.write_text("api-key: sk-config-secret\n")
    path.chmod(0o644)
    parser = cli.build_parser()
    with pytest.raises(HyraxInputError) as e:
        apply_yaml(parser._subparsers._group_actions[0].choices["serve"], ["--config", str(path)])
    msg = str(e.value)
    assert "api-key" in msg and "mode 644" in msg and "chmod 600" in msg and "secret" not in msg, msg
    path.write_text("port: 8001\n")  # no key in it: its mode is the operator's business
    apply_yaml(parser._subparsers._group_actions[0].choices["serve"], ["--config", str(path)])
