"""`hyrax eval`: accuracy of a live server on the held-out recall split (the demo task)."""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.arg_types import positive_int


def add_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("eval", help="score a live server on the demo task's held-out split",
                       description="Run the held-out recall problems against a live server through the "
                                   "official openai client (completions, temperature 0, stop at EOS) and "
                                   "print accuracy and invalid-answer rate.")
    p.add_argument("--base-url", help="server URL, e.g. http://127.0.0.1:8000 (with or without /v1)")
    p.add_argument("--limit", type=positive_int, default=200, help="held-out problems to run (default 200)")
    p.add_argument("--concurrency", type=positive_int, default=8, help="requests in flight (default 8)")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--api-key", default=None, help="API key (default: $OPENAI_API_KEY, else none)")
    p.add_argument("--json", action="store_true", help='print {"accuracy", "invalid_rate", "n"} as JSON')
    p.add_argument("--write-jsonl", metavar="PATH", default=None,
                   help="instead of evaluating, write the first --limit held-out problems as JSON lines "
                        "(prompt, target, answer) for other harnesses, e.g. lm-eval's local-completions "
                        "(hyrax/tasks/lm_eval/)")
    p.set_defaults(func=run)
    return p


def run(a: argparse.Namespace) -> int:
    from hyrax.tasks import recall
    from hyrax.tasks.evaluate import run_server

    problems = recall.heldout(a.limit)
    if a.write_jsonl:
        with open(a.write_jsonl, "w", encoding="utf-8") as f:
            for p in problems:
                f.write(json.dumps({"prompt": p.prompt, "target": p.completion, "answer": p.answer}) + "\n")
        print(f"hyrax: wrote {len(problems)} held-out problems to {a.write_jsonl}", file=sys.stderr)
        return 0
    if not a.base_url:
        raise HyraxInputError("--base-url is required (unless --write-jsonl)")
    t0 = time.perf_counter()
    completions, errors = run_server(a.base_url, problems, a.concurrency, a.model,
                                     a.api_key or os.environ.get("OPENAI_API_KEY") or "EMPTY")
    result = recall.score(problems, completions)
    if a.json:
        print(json.dumps({**result, "errors": errors}))
    else:
        print(f"accuracy     {result['accuracy']:.3f}  ({round(result['accuracy'] * result['n'])}/{result['n']})")
        print(f"invalid rate {result['invalid_rate']:.3f}")
        if errors:
            print(f"errors       {errors} request(s) failed (counted invalid)")
        print(f"# {time.perf_counter() - t0:.1f}s, concurrency {a.concurrency}", file=sys.stderr)
    return 0
