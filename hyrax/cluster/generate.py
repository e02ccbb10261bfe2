"""`hyrax generate`: offline, in-process generation through the engine (no Ray)."""
from __future__ import annotations

import argparse
import json
import sys
import time

from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SEED_MAX, SEED_MIN, SamplingParams
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import resolve_model_path
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.tokenizer import load_tokenizer
from hyrax.api.context_limit import ContextExceeded, completion_budget
from hyrax.env import apply_torch_threads
from hyrax.cluster.arg_types import fraction, int_in, non_negative_float, non_negative_int, positive_int, token_ids
from hyrax.cluster.engine_args import RAY_ONLY, add_engine_args, engine_config_from_args

DEFAULT_MAX_TOKENS = 32  # without --max-tokens, capped to what the context leaves (the HTTP API's default is 16)


def add_parser(sub) -> None:
    p = sub.add_parser("generate", help="generate text offline in this process (no Ray, no server)",
                       description="Run prompts through the Hyrax engine in-process.")
    p.add_argument("--model", default="demo", help="checkpoint directory, a Hugging Face repo id in the local cache "
                   "(org/name[@revision], never downloaded), or 'demo' (default)")
    p.add_argument("--prompt", action="append", default=[], help="a text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], type=token_ids,
                   help="comma-separated token ids (repeatable)")
    p.add_argument("--prompts-file", help="JSONL file: one {\"prompt\": ...} or {\"prompt_ids\": [...]} per line, no "
                                          "other key (the sampling options apply to every prompt)")
    p.add_argument("--max-tokens", type=positive_int, default=None,
                   help=f"tokens to generate per prompt (default: {DEFAULT_MAX_TOKENS}); given, prompt + max tokens "
                        "must fit the model's context (else an error, as over HTTP); not given, it is capped to what "
                        "the context leaves")
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--top-p", type=fraction, default=1.0)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--seed", type=int_in(SEED_MIN, SEED_MAX), default=None)
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object with outputs and stats")
    add_engine_args(p, in_process=True)
    p.set_defaults(func=run)


LINE_KEYS = ("prompt", "prompt_ids")  # what a --prompts-file line holds: one of them


def _prompts(a, tok) -> list[list[int]]:
    out = [_encode(tok, t, "--prompt") for t in a.prompt]
    out += a.prompt_ids  # lists of token ids (arg_types.token_ids)
    if a.prompts_file:
        out += _file_prompts(a.prompts_file, tok)
    if not out:
        raise HyraxInputError("give at least one --prompt, --prompt-ids or --prompts-file")
    return out


def _file_prompts(path: str, tok) -> list[list[int]]:
    """The prompts of a JSONL file; a line it cannot use is an error naming the file and line."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise HyraxInputError(f"cannot read --prompts-file: {e.strerror}") from None
    out = []
    for n, raw in enumerate(data.splitlines(), 1):  # bytes: only \n, \r end a line (U+2028 may be in a string)
        where = f"{path}:{n}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HyraxInputError(f"{where}: not valid UTF-8") from None
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            raise HyraxInputError(f"{where}: not valid JSON") from None
        if not isinstance(obj, dict):
            raise HyraxInputError(f"{where}: expected {{\"prompt\": str}} or {{\"prompt_ids\": [int]}}")
        unknown = [k for k in obj if k not in LINE_KEYS]
        if unknown:
            raise HyraxInputError(f"{where}: unknown key {', '.join(map(repr, unknown))}: a line holds \"prompt\" or "
                                  f"\"prompt_ids\"; sampling options (--max-tokens, --temperature, ...) apply to every "
                                  f"prompt")
        if len(obj) != 1:
            raise HyraxInputError(f"{where}: a line holds one of \"prompt\" or \"prompt_ids\"")
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise HyraxInputError(f"{where}: \"prompt\" must be a string")
            out.append(_encode(tok, obj["prompt"], f"{where}: prompt"))
        else:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not all(type(t) is int and t >= 0 for t in ids):
                raise HyraxInputError(f"{where}: \"prompt_ids\" must be a list of token ids (ints >= 0)")
            out.append(ids)
    return out


def _encode(tok, text: str, where: str) -> list[int]:
    """`text`'s token ids; a lone surrogate (a JSON escape such as \\ud800, or command-line bytes
    that are not UTF-8) is no text a tokenizer takes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise HyraxInputError(f"{where}: not valid Unicode (it holds a lone surrogate)") from None
    return tok.encode(text)


def _budget(a: argparse.Namespace, i: int, prompt: list[int], context: int, n: int) -> int:
    """Prompt `i`'s max tokens by the HTTP API's rule (context_limit.py); its refusal names the
    prompt when there are several."""
    try:
        return completion_budget(len(prompt), a.max_tokens, DEFAULT_MAX_TOKENS, context, max_tokens_name="--max-tokens")
    except ContextExceeded as e:
        raise HyraxInputError(f"prompt {i + 1}: {e}" if n > 1 else str(e)) from None


def run(a: argparse.Namespace) -> int:
    apply_torch_threads()
    given = [flag for key, (default, flag) in RAY_ONLY.items() if getattr(a, key) != default]
    if given:
        raise HyraxInputError(f"{', '.join(given)}: applies to a Ray replica's rank actors; hyrax generate runs the "
                              f"engine in-process, without them")
    config = engine_config_from_args(a)
    path = resolve_model_path(a.model)
    cfg = ModelConfig.from_dir(path)
    tok = load_tokenizer(path, cfg.vocab_size)
    prompts = _prompts(a, tok)
    engine = load_engine(str(path), config, decode=tok.decode)
    params = [SamplingParams(max_tokens=_budget(a, i, p, engine.max_model_len, len(prompts)),
                             temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed, stop=tuple(a.stop),
                             ignore_eos=a.ignore_eos) for i, p in enumerate(prompts)]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]  # validates every prompt before running
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
