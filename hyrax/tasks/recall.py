"""Key-value recall over a long context: the demo checkpoint's synthetic task.

A problem lists `key=value` pairs, then asks for one key; the answer is that key's value,
which the model copies and ends with the EOS token:

    prompt  "c=4071;q=918;x=55802;m=2236;...;k=380?q="
    answer  "918" + <|eos|>

Keys are distinct lowercase letters, values 3..5 random digits. The asked pair always sits
more than `MIN_DISTANCE` tokens before the end of the prompt — farther back than the demo
model's sliding window — so the answer can only come from full attention or Mamba state:
lose either one (a retraction that drops or mixes up state) and the answer breaks.

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
MIN_DISTANCE = 24  # tokens from the asked key to the end of the prompt (> the demo sliding window)
HELDOUT_MOD = 10  # 1 in 10 possible prompts is held out
HELDOUT_SEED = 20240501
MAX_TOKENS = MAX_DIGITS + 2  # generation budget: the value, its terminator, one spare
_ANSWER = re.compile(rf"[0-9]{{{MIN_DIGITS},{MAX_DIGITS}}}")


@dataclass(frozen=True)
class Problem:
    prompt: str
    answer: str  # without the terminator
    distance: int  # tokens (bytes) from the asked key to the end of the prompt


def split_of(prompt: str) -> str:
    """'heldout' or 'train', decided by hashing the prompt text."""
    h = int.from_bytes(hashlib.sha256(prompt.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % HELDOUT_MOD == 0 else "train"


def _context(rng: random.Random, min_pairs: int = MIN_PAIRS) -> tuple[str, list[str], list[str], list[int]]:
    """A list of pairs: (body text, keys, values, keys' offsets in the body)."""
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


def _far(body: str, starts: list[int]) -> list[int]:
    """Pairs that may be asked: more than MIN_DISTANCE tokens before the end of the prompt."""
    end = len(body) + 2  # the prompt ends with "?<key>"
    return [i for i, s in enumerate(starts) if end - s > MIN_DISTANCE]


def make_problem(rng: random.Random) -> Problem:
    """One problem drawn from `rng` (either split)."""
    while True:
        body, keys, values, starts = _context(rng)
        far = _far(body, starts)
        if far:
            i = rng.choice(far)
            prompt = f"{body}?{keys[i]}"
            return Problem(prompt, values[i], len(prompt) - starts[i])


def training_sequence(rng: random.Random, n_queries: int, near: bool = True, min_pairs: int = MIN_PAIRS
                      ) -> list[Problem]:
    """Several training-split problems sharing one context, for one training sequence:
    `body?k1v1<eos>?k2v2<eos>...`. The first is exactly a problem's prompt + answer; each
    problem's own prompt (`body?ki`) is in the training split, so no held-out prompt is
    ever trained on, not even as a prefix. `near` also asks pairs inside the sliding window
    (never asked at evaluation): they are learnt first, by the local layers, and teach the
    copy circuit that full attention then needs for the far ones."""
    while True:
        body, keys, values, starts = _context(rng, min_pairs)
        cand = range(len(keys)) if near else _far(body, starts)
        ok = [i for i in cand if split_of(f"{body}?{keys[i]}") == "train"]
        if ok:
            picked = rng.sample(ok, min(n_queries, len(ok)))
            return [Problem(f"{body}?{keys[i]}", values[i], len(body) + 2 - starts[i]) for i in picked]


def generate(split: str, n: int, seed: int) -> list[Problem]:
    """`n` problems of `split` ('train' or 'heldout'), a pure function of (split, n, seed)."""
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
    """The answer in a completion (text before the terminator), or None when it is not a
    well-formed answer: not MIN_DIGITS..MAX_DIGITS digits, or no terminator was emitted."""
    if not terminated or not _ANSWER.fullmatch(text):
        return None
    return text


def score(problems: list[Problem], completions: list[tuple[str, bool]]) -> dict:
    """{"accuracy", "invalid_rate", "n"} of completions: (text without the terminator,
    whether the model emitted the terminator)."""
    n = len(problems)
    parsed = [parse_answer(text, term) for text, term in completions]
    correct = sum(1 for p, a in zip(problems, parsed) if a == p.answer)
    invalid = sum(1 for a in parsed if a is None)
    return {"accuracy": correct / n if n else 0.0, "invalid_rate": invalid / n if n else 0.0, "n": n}
