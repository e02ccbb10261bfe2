"""A `hyrax` command whose reader goes away (`hyrax admin pools | head -1`) stops quietly, as
`git log | head -1` does: no traceback, no "Exception ignored" line, exit status 141 (128 +
SIGPIPE, what a shell reports for a command SIGPIPE ended)."""
import os
import subprocess
import sys


def test_a_closed_stdout_ends_the_command_without_a_traceback():
    r, w = os.pipe()
    os.close(r)  # the reader is gone before the command writes: every write is EPIPE
    try:
        p = subprocess.run([sys.executable, "-m", "hyrax.cluster.cli", "generate", "--prompt", "hi",
                            "--max-tokens", "2", "--json"],
                           stdout=w, stderr=subprocess.PIPE, text=True, timeout=120, stdin=subprocess.DEVNULL)
    finally:
        os.close(w)
    assert "Traceback" not in p.stderr and "BrokenPipeError" not in p.stderr, p.stderr
    assert p.returncode == 141, (p.returncode, p.stderr)


def test_a_broken_pipe_that_is_not_stdout_still_raises(monkeypatch):
    """Only a reader that went away is quiet: another pipe of the command's own is a bug to see."""
    import argparse

    import pytest

    from hyrax.cluster import cli

    def boom(_args):
        raise BrokenPipeError("a pipe of the command's own")

    build = cli.build_parser

    def parser():
        p = build()
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                a.choices["doctor"].set_defaults(func=boom)
        return p

    monkeypatch.setattr(cli, "build_parser", parser)
    with pytest.raises(BrokenPipeError, match="of the command's own"):
        cli.main(["doctor"])
