"""Device pools: one tensor per state component, shape (layers, rows, *unit_shape).

Paged components have rows = pages * page_size; slot components have one row per slot. With the
prefix cache on, each slot component also has a checkpoint pool (`<name>.checkpoint`, the
same unit shape) that holds recurrent state at track boundaries. Built from the component
list, never by naming components.

With CUDA-graph decode (`--captured-decode cuda_graphs`) every model pool keeps `scratch` units
past its capacity (a page, a slot; `SCRATCH_UNITS`): no allocator hands them out, and a graph's
padding rows (a batch of 5 replayed by the graph of 8) read and write there
(model/cuda_graphs.py). They are the pool's last unit; the capacity and the allocator's
free + used == capacity are the same with or without it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from hyrax.actors.engine.prefix_nodes import checkpoint_pool
from hyrax.actors.model.cuda_graphs import SCRATCH_UNITS
from hyrax.actors.model.state import SLOT, TOKEN, WINDOW, ComponentSpec


@dataclass(frozen=True)
class PoolSizes:
    """Capacities in units: pages for paged components, slots for slot components."""

    page_size: int
    units: dict[str, int]
    checkpoints: int = 0  # slots of each slot component's checkpoint pool (0: no prefix cache)
    scratch: int = 0  # units each model pool keeps past its capacity, owned by nobody (graph padding)

    def rows(self, comp: ComponentSpec) -> int:
        """The rows the allocator hands out: the capacity, in rows."""
        return self.units[comp.name] * (self.page_size if comp.paged else 1)

    def allocated_rows(self, comp: ComponentSpec) -> int:
        """The rows of the pool's tensor: the capacity and the scratch units after it."""
        return (self.units[comp.name] + self.scratch) * (self.page_size if comp.paged else 1)


def scratch_units(config) -> int:
    """Units each pool keeps past its capacity for an EngineConfig: CUDA-graph decode pads its
    batches into them; every other mode needs none."""
    return SCRATCH_UNITS if config.captured_decode == "cuda_graphs" else 0


def scratch_bytes(components: tuple[ComponentSpec, ...], page_size: int, scratch: int) -> int:
    """Bytes of `scratch` units past every model pool's capacity (a page of rows for a paged
    component, a row for a slot component), as `allocate_device_pools` adds them."""
    return sum(scratch * (page_size if c.paged else 1) * c.row_bytes for c in components)


def pool_sizes(components: tuple[ComponentSpec, ...], page_size: int, kv_capacity_tokens: int,
               mamba_slots: int, swa_capacity_tokens: int | None = None, checkpoints: int = 0,
               scratch: int = 0) -> PoolSizes:
    """Units per component from user-facing capacities (tokens for K/V, slots for Mamba)."""
    if page_size < 1:
        raise ValueError("page_size must be >= 1")
    units = {}
    for c in components:
        if c.kind == TOKEN:
            units[c.name] = -(-kv_capacity_tokens // page_size)
        elif c.kind == WINDOW:
            units[c.name] = -(-(swa_capacity_tokens or kv_capacity_tokens) // page_size)
        else:
            units[c.name] = mamba_slots
    return PoolSizes(page_size, units, checkpoints, scratch)


def pool_sizes_for(components: tuple[ComponentSpec, ...], config) -> PoolSizes:
    """Units per component for an EngineConfig's capacities: the one place every replica,
    rank and in-process engine sizes its pools from."""
    return pool_sizes(components, config.page_size, config.kv_capacity_tokens, config.mamba_slots,
                      config.swa_capacity_tokens, config.checkpoint_slots, scratch_units(config))


def checkpoint_pools(components: tuple[ComponentSpec, ...], sizes: PoolSizes) -> dict[str, ComponentSpec]:
    """Checkpoint pool name -> the slot component it checkpoints (empty without a prefix cache)."""
    if not sizes.checkpoints:
        return {}
    return {checkpoint_pool(c.name): c for c in components if c.kind == SLOT}


def pool_bytes(components: tuple[ComponentSpec, ...], sizes: PoolSizes) -> int:
    """Bytes of the pools `allocate_device_pools` makes: each component's (its scratch units too)
    and, with the prefix cache, each checkpoint pool."""
    return (sum(sizes.allocated_rows(c) * c.row_bytes for c in components)
            + sum(sizes.checkpoints * c.row_bytes for c in checkpoint_pools(components, sizes).values()))


def allocate_device_pools(components: tuple[ComponentSpec, ...], sizes: PoolSizes,
                          device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    pools = {
        c.name: torch.zeros(len(c.layers), sizes.allocated_rows(c), *c.unit_shape, dtype=c.dtype, device=device)
        for c in components
    }
    for name, c in checkpoint_pools(components, sizes).items():
        pools[name] = torch.zeros(len(c.layers), sizes.checkpoints, *c.unit_shape, dtype=c.dtype, device=device)
    return pools


def host_pool_rows(components: tuple[ComponentSpec, ...], sizes: PoolSizes, host_pool_mb: float) -> dict[str, int]:
    """Rows of the pre-allocated host pool per component: the byte budget is shared in
    proportion to each component's device pool, so every component kind has room."""
    device_bytes = {c.name: sizes.rows(c) * c.row_bytes for c in components}
    total = sum(device_bytes.values()) or 1
    budget = host_pool_mb * 2**20
    return {c.name: int(budget * device_bytes[c.name] / total) // c.row_bytes for c in components}
