"""Build an in-process engine (one rank, no Ray) from a checkpoint or a model object."""
from __future__ import annotations

import torch

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.engine import Engine
from hyrax.actors.engine.executor import LocalExecutor
from hyrax.actors.engine.memory_budget import MemoryQuery, sized_config
from hyrax.actors.engine.pools import host_pool_rows, pool_sizes_for
from hyrax.actors.engine.rank_runtime import make_rank_runtime
from hyrax.actors.model.captured_decode import capture_decode
from hyrax.actors.model.hybrid import HybridModel, resolve_dtype
from hyrax.actors.model.loader import load_model


def engine_for_model(model: HybridModel, config: EngineConfig, decode=None,
                     device: str | torch.device = "cpu", tokenizer_dir: str | None = None,
                     memory: MemoryQuery | None = None) -> Engine:
    """`tokenizer_dir`: where tokenizer.json is, for structured output (None: byte tokens).
    With `config.gpu_memory_fraction`, the pools are sized from `device`'s memory (`memory`:
    its query; None: the device's own, CUDA only). `config.captured_decode` is applied to
    `model` here (it must not be captured already)."""
    capture_decode(model, config.captured_decode, device)
    config = config.for_device(torch.device(device).type)  # a step budget left to the device
    if config.gpu_memory_fraction is not None:
        config, _ = sized_config(model, config, memory, 0, device)
    comps = model.components
    sizes = pool_sizes_for(comps, config)
    host = host_pool_rows(comps, sizes, config.host_pool_mb)
    rank = make_rank_runtime(model, sizes, host, rank=0, faults=config.faults, device=device,
                             tokenizer_dir=tokenizer_dir)
    if config.faults.out_of_memory:  # test-only (allow_unsafe), chosen once here
        from hyrax.testing.oom import with_oom_fault
        rank = with_oom_fault(rank, config.faults, 0)
    cfg = model.cfg
    return Engine(comps, sizes, host, LocalExecutor(rank), config, cfg.vocab_size,
                  cfg.max_position_embeddings, cfg.eos_token_id, decode)


def load_engine(model_dir: str, config: EngineConfig, decode=None, device: str = "cpu") -> Engine:
    model = load_model(model_dir, dtype=resolve_dtype(config.dtype, device), device=device,
                       attn_backend=config.attention_backend, row_plans=not config.deterministic)
    return engine_for_model(model, config, decode, device, tokenizer_dir=model_dir)


def run_to_completion(engine: Engine, max_steps: int = 1_000_000) -> None:
    step = engine.step
    for _ in range(max_steps):
        if not engine.has_unfinished() and not engine.has_inflight():
            return
        step()
    raise RuntimeError(f"requests still unfinished after {max_steps} steps")
