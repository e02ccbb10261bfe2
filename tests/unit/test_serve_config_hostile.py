"""`hyrax serve --config FILE` as a careless operator writes it: every mistake is one line naming
the key, never a silent choice, never a traceback, and never a credential on the screen. None of
these tests starts Ray: they parse (and at most validate) the arguments."""
from __future__ import annotations

import pytest

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster import cli
from test_serve_config_file import parse


def main_err(tmp_path, yaml_text: str, capsys, *flags: str) -> list[str]:
    """The lines `hyrax serve --config FILE` prints on stderr, with a model that does not exist
    (were the file accepted, serve would stop there at once, before anything starts)."""
    path = tmp_path / "serve.yaml"
    path.write_text(yaml_text)
    path.chmod(0o600)  # the operator's own (a file holding api-key must be)
    assert cli.main(["serve", "--config", str(path), "--model", str(tmp_path / "no-model"), *flags]) == 2
    return capsys.readouterr().err.strip().splitlines()


def test_a_key_given_twice_is_an_error_naming_it_not_the_last_one_silently(tmp_path):
    """YAML loaders keep the last of two equal keys; the first value was silently dropped."""
    with pytest.raises(HyraxInputError, match=r"^--config: port is given twice \(lines 1 and 3\)$"):
        parse(tmp_path, "port: 8001\nmax-running: 4\nport: 8002\n")
    # two spellings of one option are one option
    with pytest.raises(HyraxInputError, match=r"^--config: max_running is given twice \(lines 1 and 2\)$"):
        parse(tmp_path, "max-running: 4\nmax_running: 5\n")


@pytest.mark.parametrize("text", [
    "port:\t8001\n",                       # a tab
    "port: [8001\n",                       # an unclosed list
    'api-key: "sk-live-123\n',             # an unclosed quote, around a secret
    "port: !!python/object/apply:os.system ['true']\n",  # a tag the safe loader has no constructor for
])
def test_a_file_that_is_not_yaml_is_one_line_without_quoting_the_file(tmp_path, capsys, text):
    """PyYAML's message is several lines and quotes the offending line, which may hold a key."""
    err = main_err(tmp_path, text, capsys)
    assert len(err) == 1 and err[0].startswith("hyrax: error: --config is not valid YAML: "), err
    assert "line 1" in err[0]
    assert "sk-live-123" not in err[0]


@pytest.mark.parametrize("text, value", [
    ("served-model-name: 1.10\n", "1.10"),    # a float: 1.1
    ("deployment: 010\n", "010"),             # YAML 1.1 octal: 8
    ("served-model-name: 0x1F\n", "0x1F"),    # hex: 31
    ("served-model-name: 1_000\n", "1_000"),  # 1000
    ("served-model-name: 1:30\n", "1:30"),    # sexagesimal: 90
    ("served-model-name: 1e3\n", "1e3"),
    ("served-model-name: 12\n", "12"),
])
def test_a_name_that_looks_like_a_number_is_kept_as_written(tmp_path, text, value):
    """A text option (a name, a key) took YAML 1.1's reading of a bare number, so the server
    answered to another name than the file's; it gets the text as written, as on the command line."""
    a = parse(tmp_path, text)
    key = text.split(":")[0].replace("-", "_")
    assert getattr(a, key) == value


def test_an_api_key_that_looks_like_a_number_is_kept_as_written(tmp_path):
    """`api-key: 0123` was the key '83' (YAML 1.1 octal): clients sending 0123 got 401."""
    assert parse(tmp_path, "api-key: 0123\n").api_key == ["0123"]
    assert parse(tmp_path, "api-key: [0123, 1.50]\n").api_key == ["0123", "1.50"]


def test_api_keys_on_the_command_line_replace_the_files(tmp_path):
    """Flags win over the file (docs/deploy.md); for --api-key the flags' keys were added to the
    file's, so a key rotated out on the command line was still accepted."""
    assert parse(tmp_path, "api-key: [old-1, old-2]\n", "--api-key", "new").api_key == ["new"]
    assert parse(tmp_path, "api-key: [old-1, old-2]\n").api_key == ["old-1", "old-2"]
    assert parse(tmp_path, "", "--api-key", "a", "--api-key", "b").api_key == ["a", "b"]


def test_an_empty_api_key_list_is_an_error_not_an_open_api(tmp_path):
    """`api-key: []` (an empty template) silently served /v1 without any key."""
    with pytest.raises(HyraxInputError, match=r"^--config: api-key is an empty list"):
        parse(tmp_path, "api-key: []\n")


@pytest.mark.parametrize("text", [
    "api-key: [[sk-live-123]]\n",
    "api-key: {sk-live-123: 1}\n",
    "api-key: [sk-live-123, {sk-live-456: 1}]\n",
])
def test_a_malformed_api_key_is_refused_without_showing_it(tmp_path, capsys, text):
    err = main_err(tmp_path, text, capsys)
    assert len(err) == 1 and err[0].startswith("hyrax: error: --config: api-key"), err
    assert "sk-live" not in err[0]


def test_an_alias_bomb_is_refused_with_a_short_error(tmp_path, capsys):
    """A value built of nested aliases (billion laughs) loads as shared references, but the error
    that showed it printed every repetition: 9**8 strings, hundreds of megabytes of text."""
    levels = ["&a [x, x, x, x, x, x, x, x, x]"] + [
        f"&{c} [{', '.join(['*' + p] * 9)}]" for p, c in zip("abcdefg", "bcdefgh")]
    err = main_err(tmp_path, f"max-running: [{', '.join(levels)}]\n", capsys)
    assert len(err) == 1 and err[0].startswith("hyrax: error: --config: max-running needs one value"), err[:1]
    assert len(err[0]) < 400


def test_an_alias_is_read_once_not_once_per_reference():
    """Reading the file's values as written walked an alias once per reference: the bomb above
    took 9**8 steps (32 s of the test suite) before it was refused. A node met again is the same
    value again, as YAML itself builds it."""
    import yaml

    from hyrax.cluster.serve import _as_written

    loader = yaml.SafeLoader("v: [&a [010, x], *a, [*a, *a]]")
    try:
        value = _as_written(loader, loader.get_single_node().value[0][1])
    finally:
        loader.dispose()
    assert value == [["010", "x"], ["010", "x"], [["010", "x"], ["010", "x"]]]
    assert value[0] is value[1] is value[2][0] is value[2][1]  # one list, four references


def test_a_file_far_larger_than_a_config_is_refused_without_reading_it_all(tmp_path, capsys):
    """`--config` pointed at the wrong file (weights, a log, /dev/zero) was read whole into memory
    (forever, for /dev/zero) before YAML looked at it."""
    path = tmp_path / "huge.yaml"
    path.write_text("max-running: 4\n" + "# padding\n" * 300_000)  # 3 MB of valid YAML
    assert cli.main(["serve", "--config", str(path), "--model", str(tmp_path / "no-model")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"hyrax: error: --config {path} is larger than 1 MiB: not a config file"]
    assert cli.main(["serve", "--config", "/dev/zero"]) == 2
    assert "larger than 1 MiB" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["", "# only a comment\n", "\ufeffmax-running: 4\n", "---\nmax-running: 4\n"])
def test_an_empty_file_a_bom_and_a_document_marker_are_fine(tmp_path, text):
    a = parse(tmp_path, text)
    assert a.max_running == (4 if "max-running" in text else 64)
