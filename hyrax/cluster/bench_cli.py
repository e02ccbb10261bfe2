"""`hyrax bench`: run the benchmark suites in the repository's `bench/` folder.

`bench/` sits at the repository root, beside the `hyrax` package, and is not installed with
it: this command imports it from the checkout this package was loaded from.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from hyrax.actors.model.errors import HyraxInputError

REPO_ROOT = Path(__file__).resolve().parents[2]


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("bench", help="run the benchmarks (ratios against baselines measured in the same run)",
                       description="Run Hyrax's benchmark suites and print a markdown table: metric, Hyrax, "
                                   "baseline, ratio, target, pass/fail. Progress goes to stderr.")
    p.add_argument("--quick", action="store_true", help="smaller workloads (about 3 minutes on 2 CPU cores)")
    p.add_argument("--json", metavar="OUT", help="also write the rows to OUT as a JSON list of objects "
                                                 "(keys: metric, hyrax, baseline, ratio, target, passed)")
    p.add_argument("--suite", action="append", metavar="NAME",
                   help="run only this suite (repeatable): serving, coordination, retraction, transfer, memory, "
                        "prefix, captured, soak, multinode; default: all but soak (10,000 requests under chaos, "
                        "about 30 minutes; --quick: 1,000) and multinode (a multi-node Ray cluster on this "
                        "machine: decode scaling over 1-3 replicas, recovery from a lost node)")
    p.set_defaults(func=run)
    return p


def load_runner():
    """`bench.runner` from the checkout this package was loaded from (put first on sys.path, so
    that an unrelated top-level `bench` module elsewhere cannot shadow it), else from sys.path."""
    ours = REPO_ROOT / "bench"
    if (ours / "runner.py").is_file():
        loaded = sys.modules.get("bench")
        if loaded is not None and Path(getattr(loaded, "__file__", None) or "/").resolve().parent != ours:
            for name in [n for n in sys.modules if n == "bench" or n.startswith("bench.")]:
                del sys.modules[name]
        if str(REPO_ROOT) in sys.path:
            sys.path.remove(str(REPO_ROOT))
        sys.path.insert(0, str(REPO_ROOT))
        return importlib.import_module("bench.runner")
    try:
        return importlib.import_module("bench.runner")
    except ModuleNotFoundError as e:
        if e.name not in ("bench", "bench.runner"):
            raise  # bench/ was found, but something it imports is missing: show that
    raise HyraxInputError(
        f"`hyrax bench` needs the repository's bench/ folder, which is not installed with the package "
        f"(looked in {ours}). Run it from a source checkout installed in editable mode (pip install -e .), "
        f"or as `python -m bench.runner` from the repository root."
    )


def run(args: argparse.Namespace) -> int:
    runner = load_runner()
    unknown = sorted(set(args.suite or ()) - set(runner.SUITES))
    if unknown:
        raise HyraxInputError(f"unknown suite(s) {', '.join(unknown)}; choose from {', '.join(runner.SUITES)}")
    return runner.run(argparse.Namespace(quick=args.quick, json=args.json, suite=args.suite, profile=None))
