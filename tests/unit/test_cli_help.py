"""`hyrax COMMAND --help` explains every option and shows every default (issue 19)."""
from __future__ import annotations

import argparse

import pytest

from hyrax.cluster.cli import _has_default, build_parser


def _commands(parser: argparse.ArgumentParser, name: str = "hyrax"):
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, sp in action.choices.items():
                yield from _commands(sp, f"{name} {sub}")


COMMANDS = dict(_commands(build_parser()))


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_has_help_and_its_default(name):
    parser = COMMANDS[name]
    text = parser.format_help()
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        flag = action.option_strings[-1] if action.option_strings else action.dest
        assert action.help, f"{name}: {flag} has no help"
        shown = parser._get_formatter()._expand_help(action)
        if action.option_strings and _has_default(action):
            assert "default" in shown, f"{name}: {flag} does not show its default: {shown!r}"
    assert text


@pytest.mark.parametrize("cmd,flag,says", [
    ("hyrax serve", "--port", "(default: 8000)"),
    ("hyrax serve", "--max-body-mb", "(default: 4.0)"),
    ("hyrax serve", "--max-running", "(default: 64)"),
    ("hyrax serve", "--max-batch-tokens", "(default: 256 on a CPU, 512 on a GPU"),
    ("hyrax serve", "--prefill-chunk", "(default: 256, or --max-batch-tokens if smaller)"),
    ("hyrax serve", "--prefill-order", "(default: shortest)"),
    ("hyrax serve", "--host-pool-mb", "(default: 256.0)"),
    ("hyrax serve", "--dtype", "(default: auto)"),
    ("hyrax serve", "--decode-tp", "default 1"),
    ("hyrax generate", "--max-tokens", "(default: 32)"),
    ("hyrax generate", "--temperature", "(default: 0.0)"),
    ("hyrax generate", "--top-p", "(default: 1.0)"),
    ("hyrax generate", "--top-k", "(default: 0)"),
    ("hyrax generate", "--seed", "random"),
    ("hyrax admin forced-retraction", "interval", "0 turns forced retraction off"),
    ("hyrax doctor", "--json", "one JSON object per check"),
    # a second server on another port writes the per-port file (README, serve.resolve_admin_token)
    ("hyrax serve", "--admin-token-file", "admin_token.<port>"),
    ("hyrax admin", "--token-file", "admin_token.<port>"),
])
def test_help_text_names_the_default(cmd, flag, says):
    parser = COMMANDS[cmd]
    action = next(a for a in parser._actions if flag in a.option_strings or a.dest == flag)
    assert says in " ".join(parser._get_formatter()._expand_help(action).split())


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_command_help_starts_with_a_description(name):
    """`hyrax doctor --help` (and each `hyrax admin ACTION --help`) had none: usage, then options."""
    parser = COMMANDS[name]
    assert parser.description, f"{name} --help has no description"
    assert " ".join(parser.description.split()) in " ".join(parser.format_help().split())


@pytest.mark.parametrize("flag", ["--no-compiled-graph", "--cpu-affinity"])
def test_generate_help_says_the_ray_only_engine_options_do_not_apply(flag):
    """The shared engine options described what they do to a Ray replica's ranks, which
    `hyrax generate` (in-process, no ranks) refuses; `hyrax serve` keeps the description."""
    def shown(cmd: str) -> str:
        parser = COMMANDS[cmd]
        action = next(a for a in parser._actions if flag in a.option_strings)
        return " ".join(parser._get_formatter()._expand_help(action).split())

    assert "does not apply to hyrax generate" in shown("hyrax generate")
    assert "rank" in shown("hyrax serve") and "does not apply" not in shown("hyrax serve")
