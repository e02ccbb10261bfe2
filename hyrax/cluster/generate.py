"""`hyrax generate`: offline, in-process generation through the engine (no Ray)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import resolve_model_path
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.tokenizer import load_tokenizer
from hyrax.env import apply_torch_threads
from hyrax.cluster.arg_types import fraction, non_negative_float, non_negative_int, positive_int
from hyrax.cluster.engine_args import add_engine_args, engine_config_from_args


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline in this process (no Ray, no server)",
                       description="Run prompts through the Hyrax engine in-process.")
    p.add_argument("--model", default="demo", help="checkpoint directory, a Hugging Face repo id in the local cache "
                   "(org/name[@revision], never downloaded), or 'demo' (default)")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    p.add_argument("--prompts-file", help="JSONL file: one {\"prompt\": ...} or {\"prompt_ids\": [...]} per line")
    p.add_argument("--max-tokens", type=positive_int, default=32)
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--top-p", type=fraction, default=1.0)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object with outputs and stats")
    add_engine_args(p)
    p.set_defaults(func=run)


def _prompts(a, tok) -> list[list[int]]:
    out = [tok.encode(t) for t in a.prompt]
    for s in a.prompt_ids:
        try:
            out.append([int(x) for x in s.split(",") if x.strip()])
        except ValueError:
            raise HyraxInputError(f"--prompt-ids must be comma-separated integers, got {s!r}") from None
    if a.prompts_file:
        try:
            lines = open(a.prompts_file, encoding="utf-8").read().splitlines()
        except OSError as e:
            raise HyraxInputError(f"cannot read --prompts-file: {e.strerror}") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise HyraxInputError(f"{a.prompts_file}:{n}: not valid JSON") from None
            if isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
                out.append(tok.encode(obj["prompt"]))
            elif isinstance(obj, dict) and isinstance(obj.get("prompt_ids"), list):
                out.append(obj["prompt_ids"])
            else:
                raise HyraxInputError(f"{a.prompts_file}:{n}: expected {{\"prompt\": str}} or {{\"prompt_ids\": [int]}}")
    if not out:
        raise HyraxInputError("give at least one --prompt, --prompt-ids or --prompts-file")
    return out


def run(a: argparse.Namespace) -> int:
    apply_torch_threads()
    config = engine_config_from_args(a)
    path = resolve_model_path(a.model)
    cfg = ModelConfig.from_dir(path)
    tok = load_tokenizer(path, cfg.vocab_size)
    prompts = _prompts(a, tok)
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed, stop=tuple(a.stop), ignore_eos=a.ignore_eos)
    engine = load_engine(str(path), config, decode=tok.decode)
    ids = [engine.add_request(p, params) for p in prompts]  # validates every prompt before running
    t0 = time.perf_counter()
    run_to_completion(engine)
    elapsed = time.perf_counter() - t0
    engine.check_invariants()
    reqs = [engine.finished_requests[i] for i in ids]
    stats = engine.stats.summary()
    stats["elapsed_s"] = round(elapsed, 4)
    stats["output_tokens_per_s"] = round(stats["generation_tokens"] / elapsed, 2) if elapsed > 0 else None
    if a.json:
        print(json.dumps({
            "outputs": [{"token_ids": r.output_ids, "text": r.text, "finish_reason": r.finish_reason} for r in reqs],
            "stats": stats,
        }))
    else:
        for i, r in enumerate(reqs):
            print(f"[{i}] ({r.finish_reason}, {len(r.output_ids)} tokens) {r.text!r}")
        print(f"# {stats['generation_tokens']} tokens in {elapsed:.2f}s; retractions={stats['retractions']} "
              f"restores={stats['restores']} fallbacks={stats['restore_fallbacks']}", file=sys.stderr)
    return 0
