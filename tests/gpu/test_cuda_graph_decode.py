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
