"""A replica lost with its node (issue 20): the gateway hands its requests to another replica as
a hand-off that carries no state, only the tokens so far (hyrax/cluster/ray_client.py). The new
replica rebuilds the state by prefill over prompt + output and continues: the request ends with
exactly the tokens an uninterrupted run gives, and the pools are clean afterwards."""
from __future__ import annotations

import pytest
import torch
from engine_helpers import assert_idle_clean, greedy, make_engine, make_prompts, reference_outputs, tiny_model

from hyrax.actors.engine.lifecycle import Outcome

MAX_TOKENS = 12


@pytest.mark.parametrize("cut", [1, 5, 11])
def test_a_stateless_handoff_is_recomputed_and_continues_exactly(cut):
    layout = "full_swa_mamba"
    prompts = make_prompts(3, seed=7)
    ref = reference_outputs(layout, torch.float32, prompts, MAX_TOKENS)
    engine = make_engine(tiny_model(layout))
    handoffs = [{"request": {"id": f"lost-{i}", "prompt_ids": p, "output_ids": list(ref[i][:cut]),
                             "params": greedy(MAX_TOKENS), "seed": 0, "retractions": 0},
                 "manifest": None, "payload": [], "lease_s": 0.0, "source": None}
                for i, p in enumerate(prompts)]
    assert [engine.import_request(h) for h in handoffs] == [Outcome.RECOMPUTE] * 3
    while engine.has_unfinished() or engine.has_inflight():
        engine.step()
        engine.check_invariants()
    assert [list(engine.finished_requests[f"lost-{i}"].output_ids) for i in range(3)] == [list(r) for r in ref]
    assert_idle_clean(engine)
