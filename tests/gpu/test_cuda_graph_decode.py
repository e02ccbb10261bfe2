"""CUDA-graph decode steps (hyrax/actors/model/cuda_graphs.py) against the eager CUDA run
(skipped without CUDA). NOT YET RUN: no GPU was available when the path was written; this is
the check to run first where one is."""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import demo_greedy
from hyrax.actors.model.errors import HyraxInputError

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

LENGTHS = (5, 40, 130, 77, 9)


def test_cuda_graph_decode_gives_the_eager_tokens_with_retraction():
    kw = dict(dtype="float32", attention_backend="sdpa", forced_retraction_interval=3)
    eager, _ = demo_greedy("cuda", LENGTHS, **kw)
    graphs, stats = demo_greedy("cuda", LENGTHS, captured_decode="cuda_graphs", **kw)
    assert graphs == eager
    assert stats["retractions"] >= 3


def test_cuda_graph_decode_refuses_the_flash_backend():
    pytest.importorskip("vllm_flash_attn")
    with pytest.raises(HyraxInputError, match="needs --attention-backend sdpa"):
        demo_greedy("cuda", (5,), dtype="bfloat16", attention_backend="vllm_flash_attn",
                    captured_decode="cuda_graphs")


def _staggered(captured_decode: str):
    """Five requests ending at different steps (decode batches of 5, 4, 3, 2, 1), greedy: their
    tokens, and the model (its graphs, with cuda_graphs)."""
    from hyrax.actors.engine.config import EngineConfig
    from hyrax.actors.engine.local import engine_for_model, run_to_completion
    from hyrax.actors.engine.request import SamplingParams
    from hyrax.actors.model.demo import DEMO_DIR
    from hyrax.actors.model.loader import load_model

    model = load_model(str(DEMO_DIR), dtype=torch.float32, device="cuda", attn_backend="sdpa", row_plans=False)
    e = engine_for_model(model, EngineConfig(deterministic=True, dtype="float32", attention_backend="sdpa",
                                             captured_decode=captured_decode), device="cuda")
    ids = [e.add_request([(7 * i + j) % 256 for j in range(n)], SamplingParams(max_tokens=6 + 4 * i, ignore_eos=True))
           for i, n in enumerate(LENGTHS)]
    run_to_completion(e)
    e.check_invariants()
    assert e.is_idle_clean()
    return [e.finished_requests[i].output_ids for i in ids], model


def test_cuda_graph_decode_pads_batches_to_buckets_and_gives_the_eager_tokens():
    """Batches of 5 to 1 sequences replay the graphs of buckets 8, 4, 2 and 1 (padding rows on
    the pools' scratch unit), and every request's tokens are the eager run's."""
    eager, _ = _staggered("off")
    graphs, model = _staggered("cuda_graphs")
    assert graphs == eager
    buckets = {key[0] for key in model.forward.decode.graphs}
    assert {4, 2, 1} <= buckets <= {8, 4, 2, 1}, buckets  # batches of 3 replay the graph of 4
