"""The step budget (`--max-batch-tokens`) left to the device: 256 tokens on a CPU (measured,
docs/architecture.md "Step budget"), the earlier 512 on CUDA (not measured there), never below the
prefill chunk; a budget given is kept on every device, and an engine is never built with an
unresolved one."""
from __future__ import annotations

import argparse

import pytest

from hyrax.actors.engine.config import MAX_BATCH_TOKENS, MAX_BATCH_TOKENS_CUDA, EngineConfig
from hyrax.cluster.engine_args import add_engine_args, engine_config_from_args


def _cli(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_the_cli_leaves_the_budget_to_the_device_unless_given():
    auto = _cli()
    assert auto.max_batch_tokens is None and auto.prefill_chunk == 256
    assert auto.for_device("cpu").max_batch_tokens == MAX_BATCH_TOKENS == 256
    assert auto.for_device("cuda").max_batch_tokens == MAX_BATCH_TOKENS_CUDA == 512
    given = _cli("--max-batch-tokens", "300")
    assert given.for_device("cpu").max_batch_tokens == given.for_device("cuda").max_batch_tokens == 300


def test_an_automatic_budget_is_never_below_the_prefill_chunk():
    cfg = _cli("--prefill-chunk", "400")
    assert cfg.for_device("cpu").max_batch_tokens == 400
    assert cfg.for_device("cuda").max_batch_tokens == 512
    assert _cli("--prefill-chunk", "1000").for_device("cuda").max_batch_tokens == 1000


def test_an_in_process_engine_resolves_it_for_its_device_and_a_bare_engine_refuses_none():
    import dataclasses

    from hyrax.actors.engine.engine import Engine
    from hyrax.actors.engine.local import load_engine
    from hyrax.actors.model.demo import DEMO_DIR

    engine = load_engine(str(DEMO_DIR), _cli())  # the CPU: 256
    assert engine.config.max_batch_tokens == 256 and engine.scheduler.config.max_batch_tokens == 256
    with pytest.raises(ValueError, match="step budget is left to the device"):
        Engine(engine.components, engine.sizes, {}, engine.executor, dataclasses.replace(engine.config,
               max_batch_tokens=None), 264, 2048)
