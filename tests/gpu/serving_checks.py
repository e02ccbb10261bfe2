"""What a GPU deployment runs beyond per-request greedy steps, as functions of the device, so
the CUDA tests (test_gpu_serving.py) run them on "cuda" and their bodies can be checked on
"cpu" on a machine without one (`python tests/gpu/serving_checks.py cpu`).

Every run ends with the allocation invariants and the idle-clean check.
"""
from __future__ import annotations

import sys

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.lifecycle import Outcome
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams, State
from hyrax.actors.model.demo import DEMO_DIR

LENGTHS = (5, 40, 130, 77, 9, 300)
NEW_TOKENS = 16


def prompts() -> list[list[int]]:
    return [[(7 * i + j) % 256 for j in range(n)] for i, n in enumerate(LENGTHS)]


def sampled(i: int) -> SamplingParams:
    """Non-greedy, seeded: the same draws on every device (sampler.uniform)."""
    return SamplingParams(max_tokens=NEW_TOKENS, temperature=0.8, top_k=40, top_p=0.9, seed=1000 + i,
                          ignore_eos=True)


def greedy(i: int) -> SamplingParams:
    return SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


def run(device: str, config: EngineConfig, params=greedy) -> list[list[int]]:
    """Every prompt at once through one engine (batched steps unless config is deterministic)."""
    e = load_engine(str(DEMO_DIR), config, device=device)
    ids = [e.add_request(p, params(i)) for i, p in enumerate(prompts())]
    run_to_completion(e)
    e.check_invariants()
    assert e.is_idle_clean()
    return [e.finished_requests[i].output_ids for i in ids]


def handed_off(device: str, config: EngineConfig, after: int = 3) -> list[list[int]]:
    """Each request moved mid-decode from one engine to another on `device` (export, verified
    import, release), finished there."""
    src = load_engine(str(DEMO_DIR), config, device=device)
    dst = load_engine(str(DEMO_DIR), config, device=device)
    ids = [src.add_request(p, greedy(i)) for i, p in enumerate(prompts())]
    for _ in range(10_000):
        if not src.has_unfinished():
            break
        src.step()
        for rid in ids:
            req = src.requests.get(rid)
            if req is not None and req.state == State.RUNNING and len(req.output_ids) >= after:
                src.sync()
                outcome = dst.import_request(src.export_running(rid))
                assert outcome == Outcome.VERIFIED, outcome
                assert src.release_handoff(rid)
    run_to_completion(src)
    run_to_completion(dst)
    for e in (src, dst):
        e.check_invariants()
        assert e.is_idle_clean()
    return [dst.finished_requests[i].output_ids for i in ids]


def agreement(a: list[list[int]], b: list[list[int]]) -> list[int]:
    """Per request, how many leading tokens two runs share."""
    out = []
    for x, y in zip(a, b):
        n = 0
        while n < min(len(x), len(y)) and x[n] == y[n]:
            n += 1
        out.append(n)
    return out


if __name__ == "__main__":
    device = sys.argv[1] if len(sys.argv) > 1 else "cpu"
    batched = EngineConfig(dtype="float32")
    det = EngineConfig(deterministic=True, dtype="float32")
    print("sampled", run(device, batched, sampled))
    print("overlap", run(device, EngineConfig(deterministic=True, dtype="float32", overlap=True)) == run(device, det))
    print("handoff", handed_off(device, det) == run(device, det))
