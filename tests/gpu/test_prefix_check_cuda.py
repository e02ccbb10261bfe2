"""The in-step prefix-cache check on CUDA (skipped without CUDA): the checkpoint slots a hit
copies are hashed on the GPU inside the step; a checkpoint changed after it was cached is
revoked and the request recomputes, giving the tokens of the run without a cache."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import load_engine, run_to_completion
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.demo import DEMO_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

PROMPT = [(11 * j) % 256 for j in range(600)]  # deterministic mode: a hit at the 512-token chunk cut


def _run(engine) -> list[int]:
    rid = engine.add_request(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True))
    run_to_completion(engine)
    engine.check_invariants()
    return engine.finished_requests[rid].output_ids


def test_a_changed_checkpoint_on_the_gpu_is_revoked_and_the_request_recomputes():
    config = EngineConfig(deterministic=True, dtype="float32")
    want = _run(load_engine(str(DEMO_DIR), EngineConfig(deterministic=True, dtype="float32", prefix_cache=False),
                            device="cuda"))
    e = load_engine(str(DEMO_DIR), config, device="cuda")
    assert _run(e) == want
    assert _run(e) == want and e.stats.prefix.hits == 1  # the repeat hit, its check passed on the GPU
    e.executor.rank.pools["mamba_ssm.checkpoint"] += 1.0
    assert _run(e) == want
    assert e.stats.prefix.corrupt >= 1 and e.stats.prefix.hits == 1
    assert e.stats.finished["error"] == 0 and e.is_idle_clean()
