"""Delayed key-value recall: the demo checkpoint's synthetic task.

A prompt lists `key value` pairs and ends with a question `?<key>`. The model first recites a
fixed delay line, then the asked key's value, then the EOS token:

    prompt      "c4071;x55802;q918;m2236;...;k380?q"
    completion  "ABCDEFGHIJKLMNOPQRST" "918" <|eos|>

Keys are distinct lowercase letters, values MIN_DIGITS..MAX_DIGITS random digits; the asked
pair sits more than MIN_DISTANCE tokens before the question. The delay line (DELAY, longer
than the demo model's sliding window) puts the value's digits out of the window's reach of
both the question and the asked pair. Producing them takes two long-range hops — recall the
asked key, then find its pair — and the model has a single full-attention layer for one of
them, so the other must go through Mamba's recurrent state, carried across the decode steps
of the delay line. Lose or mix up either the full-attention K/V or the Mamba state of a
request in the middle of its answer (what a faulty retraction does) and the answer breaks.

Splits are defined by the problem text itself: a prompt belongs to the held-out split when
its SHA-256 falls in a fixed 1/HELDOUT_MOD bucket. Training draws reject held-out prompts, so
the two splits can never overlap, whatever the seeds.
"""
from __future__ import annotations

import hashlib
import random
import re
import string
from dataclasses import dataclass

KEYS = string.ascii_lowercase
MIN_PAIRS, MAX_PAIRS = 8, 12
MIN_DIGITS, MAX_DIGITS = 3, 5
MIN_DISTANCE = 24  # tokens from the asked pair to the end of the prompt (> the demo sliding window)
DELAY = string.ascii_uppercase[:14][::-1]  # "NML...BA": recited before the value, counting down to A
HELDOUT_MOD = 10  # 1 in 10 possible prompts is held out
HELDOUT_SEED = 20240501
MAX_TOKENS = len(DELAY) + MAX_DIGITS + 2  # generation budget: delay, value, terminator, one spare
_ANSWER = re.compile(rf"{DELAY}([0-9]{{{MIN_DIGITS},{MAX_DIGITS}}})")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # the value: the completion is DELAY + answer + EOS
    distance: int  # tokens (bytes) from the asked pair to the end of the prompt
    delay: int = len(DELAY)  # training curriculum only: recite just the last `delay` letters

    @property
    def completion(self) -> str:
        return DELAY[len(DELAY) - self.delay:] + self.answer


def split_of(prompt: str) -> str:
    """'heldout' or 'train', decided by hashing the prompt text."""
    h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % HELDOUT_MOD == 0 else "train"


def _context(rng: random.Random, min_pairs: int) -> tuple[str, list[str], list[str], list[int]]:
    """(body text, keys, values, offset of each pair in the body)."""
    n = rng.randint(min_pairs, MAX_PAIRS)
    keys = rng.sample(KEYS, n)
    values = ["".join(rng.choice(string.digits) for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS)))
              for _ in range(n)]
    pairs = [f"{k}{v}" for k, v in zip(keys, values)]
    starts, off = [], 0
    for p in pairs:
        starts.append(off)
        off += len(p) + 1
    return ";".join(pairs), keys, values, starts


def _problem(body: str, key: str, value: str, start: int) -> Problem:
    prompt = f"{body}?{key}"
    return Problem(prompt, value, len(prompt) - start)


def make_problem(rng: random.Random) -> Problem:
    """One evaluation-style problem drawn from `rng` (either split)."""
    while True:
        body, keys, values, starts = _context(rng, MIN_PAIRS)
        far = [i for i, s in enumerate(starts) if len(body) + 2 - s > MIN_DISTANCE]
        if far:
            i = rng.choice(far)
            return _problem(body, keys[i], values[i], starts[i])


def training_problem(rng: random.Random, min_pairs: int = 2, max_delay: int = len(DELAY)) -> Problem:
    """A training-split problem. Training contexts may be shorter (from `min_pairs` pairs) and
    may ask any pair, also ones closer than MIN_DISTANCE: easier cases that are learnt first.
    The delay line is cut to its last `d` letters, d drawn from 0..`max_delay` with half the
    draws at `max_delay` itself (the curriculum's frontier)."""
    while True:
        body, keys, values, starts = _context(rng, min_pairs)
        i = rng.randrange(len(keys))
        p = _problem(body, keys[i], values[i], starts[i])
        if split_of(p.prompt) == "train":
            d = max_delay if rng.random() < 0.5 else rng.randint(0, max_delay)
            return Problem(p.prompt, p.answer, p.distance, d)


def generate(split: str, n: int, seed: int) -> list[Problem]:
    """`n` evaluation-style problems of `split` ('train' or 'heldout'), a pure function of
    (split, n, seed)."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split must be 'train' or 'heldout', got {split!r}")
    rng = random.Random(f"{split}:{seed}")
    out: list[Problem] = []
    while len(out) < n:
        p = make_problem(rng)
        if split_of(p.prompt) == split:
            out.append(p)
    return out


def heldout(n: int = 1000) -> list[Problem]:
    """The held-out evaluation set (fixed seed): its first `n` problems."""
    return generate("heldout", n, HELDOUT_SEED)


def parse_answer(text: str, terminated: bool = True) -> str | None:
    """The value in a completion (text before the terminator), or None when the completion is
    not well formed: no terminator, a wrong delay line, or not MIN_DIGITS..MAX_DIGITS digits."""
    m = _ANSWER.fullmatch(text) if terminated else None
    return m.group(1) if m else None


def score(problems: list[Problem], completions: list[tuple[str, bool]]) -> dict:
    """{"accuracy", "invalid_rate", "n"} of completions: (text without the terminator,
    whether the model emitted the terminator)."""
    n = len(problems)
    parsed = [parse_answer(text, term) for text, term in completions]
    correct = sum(1 for p, a in zip(problems, parsed) if a == p.answer)
    invalid = sum(1 for a in parsed if a is None)
    return {"accuracy": correct / n if n else 0.0, "invalid_rate": invalid / n if n else 0.0, "n": n}
