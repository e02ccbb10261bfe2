"""The `hyrax` command line."""
from __future__ import annotations

import argparse
import sys

from hyrax import __version__
from hyrax.actors.model.errors import HyraxInputError, StartupFailure


def build_parser() -> argparse.ArgumentParser:
    from hyrax.cluster import admin_cli, bench_cli, eval_cli, generate, serve, train_demo_cli

    p = argparse.ArgumentParser(prog="hyrax", description="Serve hybrid (attention + Mamba2) language models on Ray.")
    p.add_argument("--version", action="version", version=f"hyrax {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    generate.add_parser(sub)
    serve.add_parser(sub)
    admin_cli.add_parser(sub)
    bench_cli.add_parser(sub)
    train_demo_cli.add_parser(sub)
    eval_cli.add_parser(sub)
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
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except HyraxInputError as e:
        print(f"hyrax: error: {e}", file=sys.stderr)
        return 2
    except StartupFailure as e:
        print(f"hyrax: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
