"""The test-only slow-device fault (`--unsafe-step-delay-ms`): every rank step sleeps first, so a
slow-running test can keep a request in flight for a known time on a machine of any speed (the
autoscaling tests in tests/multinode need requests that outlast a scale-down). It is refused
without --unsafe-allow-fault-injection, changes no token, and is checked for range."""
from __future__ import annotations

import argparse
import dataclasses
import time

import pytest

from engine_helpers import BASE_CONFIG, HYBRID, assert_idle_clean, greedy, make_prompts, reference_outputs, tiny_model
from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from hyrax.actors.engine.local import engine_for_model, run_to_completion
from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.engine_args import add_engine_args, engine_config_from_args

import torch


def _config(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_the_delay_is_refused_without_the_unsafe_flag_and_checked_for_range():
    with pytest.raises(HyraxInputError, match="test-only"):
        _config("--unsafe-step-delay-ms", "20")
    assert _config("--unsafe-allow-fault-injection", "--unsafe-step-delay-ms", "20").faults.step_delay_ms == 20
    for bad in ("-1", "1e9", "nan"):
        with pytest.raises(HyraxInputError, match="step_delay_ms"):
            _config("--unsafe-allow-fault-injection", "--unsafe-step-delay-ms", bad)


def test_every_step_waits_the_delay_and_no_token_changes():
    prompts = make_prompts(3, seed=8)
    want = reference_outputs(HYBRID, torch.float32, prompts, 6)
    config = dataclasses.replace(EngineConfig(**BASE_CONFIG), faults=UnsafeFaults(step_delay_ms=30.0),
                                 allow_unsafe=True)
    e = engine_for_model(tiny_model(HYBRID), config)
    ids = [e.add_request(p, greedy(6)) for p in prompts]
    t0, steps0 = time.monotonic(), e.stats.steps
    run_to_completion(e)
    ran = e.stats.steps - steps0
    assert ran >= 6 and time.monotonic() - t0 >= ran * 0.030  # a lower bound: each step slept first
    assert [e.finished_requests[i].output_ids for i in ids] == want
    assert_idle_clean(e)
