"""The sampler's logit processing (penalties, logit_bias, min_tokens) on CUDA equals the CPU
computation (skipped without CUDA)."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hyrax.actors.engine.plan import SamplingSpec
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.engine.sampler import process_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def test_process_logits_on_cuda_equals_cpu():
    V, B = 32000, 16
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(B, V, generator=g) * 4
    rng = np.random.default_rng(0)
    histories = [rng.integers(0, V, size=int(rng.integers(10, 600))).astype(np.int64) for _ in range(B)]
    p = SamplingParams(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3,
                       logit_bias=((5, 3.0), (17, -100.0)), min_tokens=50, stop_token_ids=(3,))
    specs = [SamplingSpec.of(p if i % 3 else SamplingParams(), 1, min(i * 7, len(h)), h.tolist())
             for i, h in enumerate(histories)]
    hist = [h if s.process is not None else None for h, s in zip(histories, specs)]
    cpu = process_logits(logits, specs, hist, (2,))
    gpu = process_logits(logits.cuda(), specs, hist, (2,))
    torch.testing.assert_close(gpu.cpu(), cpu, rtol=0, atol=1e-12)
    assert not torch.equal(cpu[1], logits[1].double())
