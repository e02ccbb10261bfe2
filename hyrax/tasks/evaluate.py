"""Accuracy of a checkpoint on the held-out recall split, two ways:

- `run_in_process`: the in-process engine (`load_engine`), all problems queued at once and
  `max_running` of them decoding together — any EngineConfig (forced retraction, backup
  mode, fault injection) applies.
- `run_server`: a live `hyrax serve` through the official `openai` client (completions
  endpoint, temperature 0), `concurrency` requests in flight.

Both decode greedily and stop at the EOS terminator; a completion that does not end with
it, or is not MIN_DIGITS..MAX_DIGITS digits, is invalid.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.demo import EOS
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.tokenizer import load_tokenizer
from hyrax.tasks import recall

Completion = tuple[str, bool]  # (text before the terminator, terminator emitted)


def run_in_process(model_dir: str | Path, problems: list[recall.Problem], config: EngineConfig
                   ) -> tuple[list[Completion], list[list[int]], dict]:
    """Greedy completions, their token ids, and the engine's stats summary."""
    model_dir = str(model_dir)
    tok = load_tokenizer(model_dir, ModelConfig.from_dir(model_dir).vocab_size)
    engine = load_engine(model_dir, config)
    params = SamplingParams(max_tokens=recall.MAX_TOKENS, temperature=0.0, stop_token_ids=(EOS,))
    ids = [engine.add_request(tok.encode(p.prompt), params) for p in problems]
    run_to_completion(engine)
    engine.check_invariants()  # free + used == capacity, no index owned twice
    if not engine.is_idle_clean():
        raise RuntimeError("the engine still holds state after every request finished")
    reqs = [engine.finished_requests[i] for i in ids]
    out = [(tok.decode(r.output_ids), r.finish_reason == "stop") for r in reqs]
    return out, [list(r.output_ids) for r in reqs], engine.stats.summary()


def _v1(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def run_server(base_url: str, problems: list[recall.Problem], concurrency: int = 8, model: str | None = None,
               api_key: str = "EMPTY", timeout: float = 120.0) -> tuple[list[Completion], int]:
    """Greedy completions from a live server, and how many requests failed (counted invalid)."""
    from openai import OpenAI

    client = OpenAI(base_url=_v1(base_url), api_key=api_key, timeout=timeout, max_retries=2)
    if model is None:
        try:
            name = client.models.list().data[0].id
        except Exception as e:  # unreachable, refused, unauthorised: one line, not a traceback
            raise HyraxInputError(f"cannot list the models at {_v1(base_url)}: {type(e).__name__}: {e}") from None
    else:
        name = model

    def one(p: recall.Problem) -> Completion | None:
        try:
            r = client.completions.create(model=name, prompt=p.prompt, max_tokens=recall.MAX_TOKENS,
                                          temperature=0.0)
        except Exception:  # any API/transport error: the problem counts as invalid
            return None
        c = r.choices[0]
        return c.text, c.finish_reason == "stop"

    with ThreadPoolExecutor(max(1, concurrency)) as ex:
        got = list(ex.map(one, problems))
    errors = sum(1 for g in got if g is None)
    return [g if g is not None else ("", False) for g in got], errors
