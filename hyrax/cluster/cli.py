"""The `hyrax` command line."""
from __future__ import annotations

import argparse
import os
import sys

from hyrax import __version__
from hyrax.actors.model.errors import HyraxInputError, StartupFailure
from hyrax.cluster.arg_types import OneLineParser


# Help for the options whose definition has none, by option string (or positional name), so
# that `hyrax COMMAND --help` explains every option; tests/unit/test_cli_help.py keeps it so.
FALLBACK_HELP = {
    # engine (serve, generate)
    "--dtype": "dtype of weights, activations and K/V state (recurrent state is float32, or float64 with float64)",
    # serve
    "--port": "gateway port",
    "--max-body-mb": "largest request body in MiB; a larger one is answered 413",
    "--prefill-replicas": "replicas of the prefill role (default 1)",
    "--prefill-tp": "TP size of each prefill replica (default 1)",
    "--decode-replicas": "replicas of the decode role (default 1)",
    "--decode-tp": "TP size of each decode replica (default 1)",
    # generate
    "--max-tokens": "tokens to generate per prompt",
    "--temperature": "sampling temperature; 0 is greedy",
    "--top-p": "nucleus sampling: keep the most likely tokens up to this probability mass (1 = off)",
    "--top-k": "keep only the k most likely tokens (0 = off)",
    "--seed": "sampling seed, a signed 64-bit integer (default: a random one per request)",
    "--ignore-eos": "keep generating past the end-of-sequence token",
    # train-demo
    "--batch-size": "sequences per optimizer step",
    "--lr": "peak learning rate",
    # admin
    "--count": "this many requests, chosen by the victim policy (fewest generated tokens first, then longest prompt)",
    "--all": "every running request",
    "--mode": "backup mode (default: the server's --retraction-backup)",
    "ids": "request ids",
    "interval": "retract one running request every this many steps; 0 turns forced retraction off",
    "id": "request id",
    "replica": "the replica, as ROLE/INDEX (e.g. decode/0)",
}


class _DefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help unless it already says what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.option_strings and "default" not in text and action.nargs != 0 and _has_default(action):
            text += " (default: %(default)s)"
        return text


def _has_default(action: argparse.Action) -> bool:
    d = action.default
    return not (d is None or d is False or d == [] or d == argparse.SUPPRESS)  # 0 and 0.0 are defaults


def _document(parser: argparse.ArgumentParser) -> None:
    """Every option of `parser` and its subcommands gets help (FALLBACK_HELP where its definition
    has none) and shows its default; a subcommand without a description gets its one-line help
    as one, so that its --help says what it does."""
    parser.formatter_class = _DefaultsFormatter
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {a.dest: a.help for a in action._choices_actions}
            for name, sp in action.choices.items():
                if not sp.description and helps.get(name):
                    sp.description = helps[name][0].upper() + helps[name][1:] + "."
                _document(sp)
        elif action.help is None:
            key = action.option_strings[-1] if action.option_strings else action.dest
            action.help = FALLBACK_HELP.get(key)


def build_parser() -> argparse.ArgumentParser:
    from hyrax.cluster import admin_cli, bench_cli, doctor, eval_cli, generate, serve, train_demo_cli, undeploy_cli

    p = OneLineParser(prog="hyrax", description="Serve hybrid (attention + Mamba2) language models on Ray.")
    p.add_argument("--version", action="version", version=f"hyrax {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    generate.add_parser(sub)
    serve.add_parser(sub)
    undeploy_cli.add_parser(sub)
    admin_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    train_demo_cli.add_parser(sub)
    eval_cli.add_parser(sub)
    doctor.add_parser(sub)
    _document(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    try:
        if argv[:1] == ["serve"]:
            from hyrax.cluster.serve import apply_yaml

            apply_yaml(parser._subparsers._group_actions[0].choices["serve"], argv[1:])
        args = parser.parse_args(argv)
    except HyraxInputError as e:
        print(f"hyrax: error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help, --version (0) or a usage error, already printed on one line (2)
        return e.code if isinstance(e.code, int) else 2
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        code = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit, so that a reader that went away is caught below
        return code
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # another pipe of the command's own (a bug to see), not its reader
        return _reader_gone()
    except HyraxInputError as e:
        print(f"hyrax: error: {e}", file=sys.stderr)
        return 2
    except StartupFailure as e:
        print(f"hyrax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def _stdout_reader_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader closed it (poll reports an error on it)."""
    import select

    try:
        p = select.poll()
        p.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & (select.POLLERR | select.POLLHUP) for _, ev in p.poll(0))
    except (OSError, ValueError, AttributeError):
        return False


def _reader_gone() -> int:
    """stdout's reader went away (`hyrax admin pools | head -1`): stop quietly, as a command that
    SIGPIPE ended would (Python ignores SIGPIPE, so a write raises instead). stdout now points at
    /dev/null, so the interpreter's own flush at exit finds nothing to fail on."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    os.close(devnull)
    return 128 + 13  # SIGPIPE


if __name__ == "__main__":
    sys.exit(main())
