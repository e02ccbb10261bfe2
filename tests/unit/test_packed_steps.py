"""Packed prefill steps (HybridModel.forward): several prompt slices of different lengths run on
their real tokens only, back to back, with mixers that need (B, T) rows given them unpacked.
The same logits as the padded layout, every layout, the whole engine."""
from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import LAYOUTS, make_engine, make_prompts, run_requests, tiny_model

from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.batch import ForwardBatch


def _run(layout: str, packing: bool, monkeypatch) -> tuple[list, list[torch.Tensor], int]:
    """Greedy outputs, every step's logits, and how many steps ran packed."""
    with monkeypatch.context() as m:
        packed = []
        real = ForwardBatch.packs.fget
        m.setattr(ForwardBatch, "packs", property(lambda b: packing and (lambda p: (packed.append(p), p)[1])(real(b))))
        model = copy.deepcopy(tiny_model(layout))
        logits = []
        forward = model.forward
        model.forward = lambda *a, **k: (lambda out: (logits.append(out.clone()), out)[1])(forward(*a, **k))
        engine = make_engine(model, deterministic=False, forced_retraction_interval=5)
        outs = run_requests(engine, make_prompts(9, seed=3, lo=3, hi=30), SamplingParams(max_tokens=8, ignore_eos=True))
        return outs, logits, sum(packed)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_steps_give_the_padded_steps_logits(layout, monkeypatch):
    padded, padded_logits, _ = _run(layout, False, monkeypatch)
    packed, packed_logits, n = _run(layout, True, monkeypatch)
    assert n > 0, "no step ran packed: the test would compare the padded layout with itself"
    assert len(packed_logits) == len(padded_logits)
    for a, b in zip(packed_logits, padded_logits):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert packed == padded
