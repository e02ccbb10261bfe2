"""Value types of the command line's options: each parses an option's text and checks its range,
so that a bad value is refused where it is parsed, naming the option (argparse adds it) and the
value, on the command line and in `hyrax serve --config` alike. NaN and the infinities are never a
count, a size or a number of seconds."""
from __future__ import annotations

import argparse
import math
from typing import Callable


class OneLineParser(argparse.ArgumentParser):
    """argparse, with a usage error on one line (`hyrax serve: error: argument --port: ...`,
    pointing at --help) instead of the usage block and then the error; exit code 2 as before.
    Subcommands' parsers are of the same class (argparse makes them with type(parent))."""

    def error(self, message: str):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _ranged(kind: type, ok: Callable[[float], bool], says: str) -> Callable[[str], float]:
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise argparse.ArgumentTypeError(f"must be {says}, got {text!r}")
        return value

    return parse


positive_int = _ranged(int, lambda v: v >= 1, "an int >= 1")
non_negative_int = _ranged(int, lambda v: v >= 0, "an int >= 0")
positive_float = _ranged(float, lambda v: math.isfinite(v) and v > 0, "a finite number > 0")
non_negative_float = _ranged(float, lambda v: math.isfinite(v) and v >= 0, "a finite number >= 0")
# seconds that reach Ray as a timeout: it takes them as int64 milliseconds (1e16 s overflows)
timeout_seconds = _ranged(float, lambda v: math.isfinite(v) and 0 < v <= 1e9, "a finite number in (0, 1e+09]")
fraction = _ranged(float, lambda v: 0 < v <= 1, "a number in (0, 1]")  # NaN fails the comparison


def int_in(lo: int, hi: int) -> Callable[[str], int]:
    """An int in [lo, hi]."""
    return _ranged(int, lambda v: lo <= v <= hi, f"an int in [{lo}, {hi}]")


def token_ids(text: str) -> list[int]:
    """A prompt as comma-separated token ids (ints >= 0), at least one; an empty item (`1,,2`,
    `1,2,`) is refused, not dropped."""
    items = text.split(",")
    if not all(x.strip().isdigit() and x.strip().isascii() for x in items):
        raise argparse.ArgumentTypeError(f"must be comma-separated token ids (ints >= 0, none empty), got {text!r}")
    return [int(x) for x in items]


def non_empty(text: str) -> str:
    """A name that must be given when the option is (an empty one would silently mean the default)."""
    if not text:
        raise argparse.ArgumentTypeError("must be non-empty, got ''")
    return text


def printable_name(text: str) -> str:
    """A name shown on one line (the served model's): non-empty, no control character."""
    if not text or any(ch < " " or "\x7f" <= ch <= "\x9f" for ch in text):
        raise argparse.ArgumentTypeError(f"must be non-empty and without control characters, got {text!r}")
    return text


def is_bearer_token(text: str) -> bool:
    """Whether `text` can travel as `Authorization: Bearer <text>` and match as it is: printable
    ASCII (what a header holds) that neither starts nor ends with a space (the gateway strips the
    header's value)."""
    return bool(text) and text == text.strip() and all(" " <= ch <= "~" for ch in text)


def bearer_token(text: str) -> str:
    """An API key or token given as an option; the error never repeats it (it is a secret)."""
    if not is_bearer_token(text):
        raise argparse.ArgumentTypeError("must be non-empty printable ASCII, no space at either end (clients send "
                                         "it as `Authorization: Bearer <key>`)")
    return text


class FlagsWinAppend(argparse._AppendAction):
    """A repeatable option (`--api-key`) whose values on the command line replace its default,
    a `hyrax serve --config` file's list, instead of adding to it: flags win over the file."""

    def __call__(self, parser, namespace, values, option_string=None):
        if getattr(namespace, self.dest, None) is self.default:  # the first one given: the default goes
            setattr(namespace, self.dest, [])
        super().__call__(parser, namespace, values, option_string)
