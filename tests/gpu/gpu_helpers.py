"""Shared by the CUDA tests: greedy runs of the shipped demo model through the in-process
engine on a device, ending with the allocation invariants and the idle-clean check.

Imported by the test modules next to it (pytest puts this folder on sys.path).
"""
from __future__ import annotations

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.demo import DEMO_DIR


def demo_greedy(device: str, lengths: tuple[int, ...], max_tokens: int = 24, **config) -> tuple[list[list[int]], dict]:
    """Outputs for one byte-pattern prompt per length, and the engine's stats summary."""
    e = load_engine(str(DEMO_DIR), EngineConfig(deterministic=True, **config), device=device)
    prompts = [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate(lengths)]
    ids = [e.add_request(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True)) for p in prompts]
    run_to_completion(e)
    e.check_invariants()
    assert e.is_idle_clean()
    return [e.finished_requests[i].output_ids for i in ids], e.stats.summary()
