"""Smoke test of `hyrax bench`: the table/JSON plumbing and the memory suite at a tiny size.
No timing is asserted — only that rows come out with the documented keys, that targets are
judged, and that state bytes equal the formula exactly."""
from __future__ import annotations

import argparse
import json

import pytest

from hyrax.cluster import bench_cli

runner = bench_cli.load_runner()  # bench/ lives beside the package, as for the CLI
from bench import report  # noqa: E402  (importable once the runner is)

KEYS = ["metric", "hyrax", "baseline", "ratio", "target", "passed"]


def test_targets_are_judged_on_the_ratio_and_rendered():
    rows = [
        report.Row("more is better", 6.0, 2.0, report.ratio(6.0, 2.0), ">= 3"),
        report.Row("less is better", 1.2, 1.0, 1.2, "<= 1.1"),
        report.Row("exact", 10, 10, report.ratio(10, 10), "== 1"),
        report.Row("informational", 1.0, None, None),
        report.Row("not measured", None, 1.0, None, ">= 0.5"),
    ]
    assert [r.passed for r in rows] == [True, False, True, None, False]
    table = report.markdown(rows).splitlines()
    assert table[0] == "| metric | Hyrax | baseline | ratio | target | pass/fail |"
    assert len(table) == 2 + len(rows)
    assert [line.rsplit("|", 2)[1].strip() for line in table[2:]] == ["pass", "**FAIL**", "pass", "info", "**FAIL**"]
    assert [list(d) for d in report.to_json(rows)] == [KEYS] * len(rows)
    with pytest.raises(ValueError):
        report.judge(1.0, "> 1")


def test_memory_suite_json_rows_and_exact_formula(tmp_path, capsys):
    out = tmp_path / "bench.json"
    assert runner.main(["--profile", "tiny", "--suite", "memory", "--json", str(out)]) == 0
    printed = capsys.readouterr()
    assert "| metric | Hyrax | baseline | ratio | target | pass/fail |" in printed.out
    assert "suite memory" in printed.err  # progress goes to stderr
    rows = json.loads(out.read_text())
    assert rows and all(list(r) == KEYS for r in rows)
    formula = [r for r in rows if "bytes_formula" in r["metric"]]
    assert {r["metric"].split(",")[1].split()[0] for r in formula} == {"full_kv", "swa_kv", "mamba_conv", "mamba_ssm"}
    for r in formula:
        assert r["hyrax"] == r["baseline"] > 0, r
        assert r["ratio"] == 1.0 and r["target"] == "== 1" and r["passed"] is True, r
    [rss] = [r for r in rows if r["metric"].startswith("RSS")]
    assert rss["hyrax"] > 0 and rss["baseline"] > 0  # measured; growth is judged only at full size


def test_cli_parser_registers_bench():
    p = argparse.ArgumentParser(prog="hyrax")
    bench_cli.add_parser(p.add_subparsers(dest="command"))
    a = p.parse_args(["bench", "--quick", "--json", "out.json", "--suite", "memory"])
    assert (a.quick, a.json, a.suite, a.func) == (True, "out.json", ["memory"], bench_cli.run)


def test_cli_help_names_every_suite_and_what_runs_by_default():
    """`hyrax bench --help` lists the suites by hand (the CLI does not import bench/ to build its
    parser): it must name every suite the runner has, and every one left out by default."""
    from bench.runner import DEFAULT_SUITES, SUITES

    p = argparse.ArgumentParser(prog="hyrax")
    bench_cli.add_parser(p.add_subparsers(dest="command"))
    sub = next(a for a in p._subparsers._group_actions[0].choices.values())
    text = " ".join(sub.format_help().split())
    listed, default = text.split("run only this suite (repeatable): ")[1].split("; default: all but ")
    assert [n.strip() for n in listed.split(",")] == list(SUITES)
    for name in set(SUITES) - set(DEFAULT_SUITES):
        assert name in default, name
