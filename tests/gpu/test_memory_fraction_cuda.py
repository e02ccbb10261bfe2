"""--gpu-memory-fraction on a real CUDA device (skipped without CUDA): the pools fill what the
fraction leaves after the memory already in use and the measured activation peak, never more,
and the engine serves with them exactly as with flag-sized pools."""
from __future__ import annotations

import pytest
import torch

from gpu_helpers import demo_greedy
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import load_engine
from hyrax.actors.engine.memory_budget import CudaMemory
from hyrax.actors.model.demo import DEMO_DIR

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MiB = 2**20
LENGTHS = (5, 40, 130)


def _fraction_for(extra_bytes: int) -> float:
    """A fraction that leaves about `extra_bytes` beyond what the device has in use now."""
    free, total = CudaMemory(torch.device("cuda", 0)).free_total()
    return min(1.0, (total - free + extra_bytes) / total)


def test_pools_fill_the_fraction_and_no_more():
    fraction = _fraction_for(2048 * MiB)
    config = EngineConfig(deterministic=True, dtype="float32", gpu_memory_fraction=fraction)
    e = load_engine(str(DEMO_DIR), config, device="cuda")
    free, total = CudaMemory(torch.device("cuda", 0)).free_total()
    pool_bytes = sum(t.numel() * t.element_size() for t in e.executor.rank.pools.values())
    assert total - free <= fraction * total + 64 * MiB, (total - free, fraction * total)
    assert pool_bytes > 1024 * MiB, pool_bytes  # weights and activations of the demo model are small
    assert e.config.kv_capacity_tokens > EngineConfig().kv_capacity_tokens
    assert e.config.gpu_memory_fraction is None  # sized: what was measured is in the capacities
    del e


def test_sized_pools_serve_like_flag_sized_ones():
    fraction = _fraction_for(512 * MiB)
    sized, _ = demo_greedy("cuda", LENGTHS, gpu_memory_fraction=fraction, dtype="float32")
    flags, _ = demo_greedy("cuda", LENGTHS, dtype="float32")
    assert sized == flags


def test_a_dropped_cuda_rank_runtime_frees_its_pools_at_once():
    """The profile's throw-away runtime is dropped right before the device is read
    (memory_budget.measure): a CUDA runtime must give its pools back by reference counting
    alone, with the cyclic collector off (tests/unit/test_memory_fraction.py checks the same
    through the whole sizing on the CPU)."""
    import gc

    from hyrax.actors.engine.pools import pool_bytes, pool_sizes
    from hyrax.actors.engine.rank_runtime import make_rank_runtime
    from hyrax.actors.model.loader import load_model

    model = load_model(str(DEMO_DIR), dtype=torch.float32, device="cuda", attn_backend="sdpa")
    sizes = pool_sizes(model.components, 16, 64 * 1024, 64)
    held = pool_bytes(model.components, sizes)
    gc.collect()
    gc.disable()
    try:
        before = torch.cuda.memory_allocated()
        runtime = make_rank_runtime(model, sizes, {}, device="cuda")
        assert torch.cuda.memory_allocated() - before >= held
        del runtime
        left = torch.cuda.memory_allocated() - before
    finally:
        gc.enable()
    assert left < held // 2, (left, held)
