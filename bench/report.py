"""Result rows, the markdown table and the JSON file.

A row compares one Hyrax figure with its baseline measured in the same run. `ratio` is what
the target is judged on; each suite says how it is formed (usually hyrax / baseline).
"""
from __future__ import annotations

import json
import math
import operator
from dataclasses import asdict, dataclass

KEYS = ("metric", "hyrax", "baseline", "ratio", "target", "passed")
_OPS = {">=": operator.ge, "<=": operator.le, "==": operator.eq}


@dataclass
class Row:
    metric: str
    hyrax: float | None
    baseline: float | None
    ratio: float | None
    target: str = ""  # ">= 3", "<= 0.15", "== 1" or "" (informational)
    passed: bool | None = None  # None: informational, or not measurable

    def __post_init__(self):
        self.passed = judge(self.ratio, self.target)


def judge(ratio: float | None, target: str) -> bool | None:
    """Whether `ratio` meets `target` ("<op> <number>"); None for no target or no ratio."""
    if not target:
        return None
    if ratio is None or (isinstance(ratio, float) and math.isnan(ratio)):
        return False
    op, _, num = target.partition(" ")
    if op not in _OPS:
        raise ValueError(f"bad target {target!r}: expected '>= x', '<= x' or '== x'")
    return bool(_OPS[op](ratio, float(num)))


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def _fmt(v) -> str:
    if v is None:
        return "—"
    if isinstance(v, bool):
        return str(v)
    if isinstance(v, int) or (isinstance(v, float) and v.is_integer() and abs(v) >= 1000):
        return f"{int(v):,}"
    a = abs(v)
    if a >= 100:
        return f"{v:,.1f}"
    if a >= 1:
        return f"{v:.3g}" if a < 10 else f"{v:.1f}"
    return f"{v:.3g}"


def markdown(rows: list[Row]) -> str:
    lines = ["| metric | Hyrax | baseline | ratio | target | pass/fail |", "|---|---:|---:|---:|---|---|"]
    for r in rows:
        verdict = {True: "pass", False: "**FAIL**", None: "info"}[r.passed]
        lines.append(f"| {r.metric} | {_fmt(r.hyrax)} | {_fmt(r.baseline)} | {_fmt(r.ratio)} | "
                     f"{r.target or '—'} | {verdict} |")
    return "\n".join(lines)


def to_json(rows: list[Row]) -> list[dict]:
    return [{k: asdict(r)[k] for k in KEYS} for r in rows]


def write_json(rows: list[Row], path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(to_json(rows), f, indent=2)
        f.write("\n")
