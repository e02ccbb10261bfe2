"""Runs the benchmark suites and prints one markdown table (stdout); progress goes to stderr.

    hyrax bench [--quick] [--json OUT] [--suite NAME ...]
    python -m bench.runner [same options]
"""
from __future__ import annotations

import argparse
import importlib
import sys
import time

from bench.common import PROFILES, env_summary, progress, shutdown_ray, single_thread_torch
from bench.report import Row, markdown, write_json

SUITES = ("serving", "coordination", "retraction", "transfer", "memory", "prefix", "captured", "soak", "multinode")
# run only when named: the soak (~30 minutes full, ~4 quick) and multinode (a 5-raylet cluster).
# captured (torch.compile of the decode forward) runs by default since its compile takes seconds
# (~40 s for the whole suite on 2 cores), not minutes
DEFAULT_SUITES = SUITES[:-2]


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quick", action="store_true", help="smaller workloads: about 3 minutes on 2 CPU cores")
    p.add_argument("--json", metavar="OUT", help="also write the rows to this file as a JSON list of objects "
                                                 "(keys: metric, hyrax, baseline, ratio, target, passed)")
    p.add_argument("--suite", action="append", choices=SUITES, metavar="NAME",
                   help=f"run only this suite (repeatable): {', '.join(SUITES)}; default: all but "
                        f"{', '.join(SUITES[len(DEFAULT_SUITES):])}")
    p.add_argument("--profile", choices=sorted(PROFILES), help=argparse.SUPPRESS)  # tests: 'tiny'


def run_suites(names, profile) -> list[Row]:
    rows: list[Row] = []
    try:
        for name in names:
            t0 = time.monotonic()
            progress(f"suite {name}: start ({profile.name})")
            mod = importlib.import_module(f"bench.{name}")
            rows += mod.run(profile)
            progress(f"suite {name}: done in {time.monotonic() - t0:.1f}s")
    finally:
        shutdown_ray()
    return rows


def run(args: argparse.Namespace) -> int:
    profile = PROFILES[args.profile or ("quick" if args.quick else "full")]
    names = [s for s in SUITES if s in (args.suite or DEFAULT_SUITES)]
    single_thread_torch()
    t0 = time.monotonic()
    rows = run_suites(names, profile)
    header = f"Hyrax bench ({profile.name}, {time.monotonic() - t0:.0f}s) — {env_summary()}"
    print(f"{header}\n\n{markdown(rows)}")
    if args.json:
        write_json(rows, args.json)
        progress(f"wrote {args.json}")
    failed = [r.metric for r in rows if r.passed is False]
    if failed:
        progress(f"{len(failed)} row(s) missed their target: " + "; ".join(failed))
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.runner", description="Hyrax benchmarks")
    add_arguments(p)
    return run(p.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
