"""Pool capacities from free device memory (`--gpu-memory-fraction F`, as vLLM's
`gpu_memory_utilization`).

On each rank, after its weights are loaded and before any pool exists:

1. `measure`: a profiling forward at the biggest steps the scheduler can make (whole prefill
   chunks filling `max_batch_tokens`, and `min(max_running, max_batch_tokens)` single tokens,
   each sampling) on throw-away pools just big enough for them gives the activation peak; the
   device's (free, total) is read after it.
2. the budget for the pools is `F * total - used - activation peak`, where `used` is every
   byte already taken on the device (this process's weights and CUDA context, other
   processes).
3. `capacities`: the budget is shared among the capacity groups (full-attention K/V tokens,
   sliding-window K/V tokens, recurrent slots with their prefix-cache checkpoint slots) in
   proportion to what the flags give, so the ratio of the flags is kept; a group whose flag
   the user set explicitly (`EngineConfig.fixed_capacities`) keeps its value and the others
   share what is left. A budget that cannot hold the fixed groups, or not even one page / slot
   of the others, is an error naming the numbers.

Every TP rank measures; the coordinator takes the smallest capacities over its ranks
(`agree`), so every rank allocates identical pool shapes. The device query is injectable
(`MemoryQuery`): CUDA uses `torch.cuda.mem_get_info` and the allocator's peak statistics; tests
pass a stand-in. Without CUDA and without a query the flag is an error (never ignored).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Protocol

import torch

from hyrax.actors.engine.config import EngineConfig, UnsafeFaults
from hyrax.actors.engine.plan import PlanEntry, SamplingSpec, StepPlan
from hyrax.actors.engine.pools import pool_sizes, scratch_bytes, scratch_units
from hyrax.actors.engine.rank_runtime import make_rank_runtime
from hyrax.actors.model.components import SLOT, TOKEN, WINDOW, ComponentSpec
from hyrax.actors.model.errors import HyraxInputError

GiB = 2**30


class MemoryQuery(Protocol):
    """A device's memory, as the sizing reads it."""

    def free_total(self) -> tuple[int, int]:
        """(free, total) bytes of the device now (cached but unused blocks given back first)."""

    def start_peak(self) -> None:
        """Start measuring the peak of bytes allocated from now on."""

    def peak_since_start(self) -> int:
        """Bytes allocated at the peak since `start_peak`, above what was allocated then."""


class CudaMemory:
    """`MemoryQuery` of one CUDA device: the driver's free/total and torch's allocator peak."""

    def __init__(self, device: torch.device):
        # by index: torch 2.4's mem_get_info refuses a device without one (the engine's "cuda")
        self.device = device if device.index is not None else torch.device("cuda", torch.cuda.current_device())
        self.base = 0

    def free_total(self) -> tuple[int, int]:
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        return torch.cuda.mem_get_info(self.device)

    def start_peak(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.base = torch.cuda.memory_allocated(self.device)

    def peak_since_start(self) -> int:
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device) - self.base


def memory_query(device: torch.device | str) -> MemoryQuery:
    """The query of `device`; a device without one makes `--gpu-memory-fraction` an error."""
    device = torch.device(device)
    if device.type == "cuda":
        return CudaMemory(device)
    raise HyraxInputError(f"--gpu-memory-fraction sizes the pools from free GPU memory, but this rank runs on "
                          f"{device.type} (torch {torch.__version__}, CUDA available: {torch.cuda.is_available()}); "
                          f"size them with --kv-capacity-tokens / --swa-capacity-tokens / --mamba-slots instead")


@dataclass(frozen=True)
class Measurement:
    """One rank's device memory after its weights were loaded and the profile ran (bytes)."""

    free: int
    total: int
    activation_peak: int
    fraction: float

    @property
    def used(self) -> int:
        """Taken before any pool: weights, CUDA context, other processes."""
        return self.total - self.free

    @property
    def budget(self) -> int:
        return int(self.fraction * self.total) - self.used - self.activation_peak

    def describe(self) -> str:
        return (f"--gpu-memory-fraction {self.fraction} of {self.total / GiB:.2f} GiB = "
                f"{self.fraction * self.total / GiB:.2f} GiB, minus {self.used / GiB:.2f} GiB in use (weights, "
                f"context, other processes) and an activation peak of {self.activation_peak / GiB:.2f} GiB, "
                f"leaves {self.budget / GiB:.3f} GiB for the pools")


# ---- 1. measure ----------------------------------------------------------------------------
def profile_plans(components: tuple[ComponentSpec, ...], config: EngineConfig):
    """The biggest steps the scheduler can make, and throw-away pool sizes that hold them:
    whole prefill chunks filling max_batch_tokens, and min(max_running, max_batch_tokens)
    single tokens; every sequence starts at position 0 and samples."""
    tokens, chunk, ps = config.max_batch_tokens, config.prefill_chunk, config.page_size
    shapes = ([chunk] * (tokens // chunk) + ([tokens % chunk] if tokens % chunk else []),
              [1] * min(config.max_running, tokens))
    n = max(len(s) for s in shapes)
    pages = -(-chunk // ps)  # per sequence
    sizes = pool_sizes(components, ps, n * pages * ps, n, n * pages * ps, scratch=scratch_units(config))
    slotted = [c.name for c in components if c.kind == SLOT]
    paged = [c.name for c in components if c.paged]
    greedy = SamplingSpec(0.0, 1.0, 0, 0, 0)
    plans = []
    for k, lengths in enumerate(shapes):
        entries = tuple(PlanEntry(f"profile-{k}-{i}", (0,) * length, 0,
                                  {name: tuple(range(i * pages, i * pages + -(-length // ps))) for name in paged},
                                  {name: i for name in slotted}, greedy)
                        for i, length in enumerate(lengths))
        plans.append(StepPlan(-1 - k, entries, {name: tuple(range(len(lengths))) for name in slotted},
                              config.deterministic))
    return sizes, plans


def measure(model, config: EngineConfig, query: MemoryQuery, rank: int = 0, device: torch.device | str = "cpu",
            broadcast=None) -> Measurement:
    """Run the profile on `model` (weights loaded, no pools yet) and read the device."""
    sizes, plans = profile_plans(model.components, config)
    runtime = make_rank_runtime(model, sizes, {}, rank, UnsafeFaults(), device, broadcast)
    query.start_peak()
    try:
        for plan in plans:
            runtime.execute(plan)
    except torch.OutOfMemoryError as e:
        raise HyraxInputError(f"the profiling forward at the biggest step (--max-batch-tokens "
                              f"{config.max_batch_tokens}, --prefill-chunk {config.prefill_chunk}, --max-running "
                              f"{config.max_running}) ran out of device memory before any pool was allocated; "
                              f"lower them: {str(e).splitlines()[0] if str(e) else 'out of memory'}") from None
    peak = query.peak_since_start()
    del runtime  # its pools go before the device is read
    free, total = query.free_total()
    return Measurement(free, total, max(peak, 0), config.gpu_memory_fraction)


# ---- 2. capacities -------------------------------------------------------------------------
@dataclass(frozen=True)
class _Group:
    field: str  # the EngineConfig capacity it sets
    value: int  # what the flags give
    unit_bytes: int  # device bytes per token / slot of this group (all its components)
    step: int  # it is a multiple of this (a page for K/V)
    fixed: bool


def _groups(components: tuple[ComponentSpec, ...], config: EngineConfig) -> tuple[list[_Group], int, int]:
    """The capacity groups this model has, and bytes fixed outside them (explicit checkpoint slots,
    the scratch units of CUDA-graph decode: a page of each paged kind, a slot)."""
    def row_bytes(kind):
        return sum(c.row_bytes for c in components if c.kind == kind)

    fixed = set(config.fixed_capacities)
    ckpt_each = 3 if config.caches_prefixes and not config.mamba_checkpoint_slots else 0
    ckpt_fixed = config.checkpoint_slots * row_bytes(SLOT) if config.caches_prefixes and not ckpt_each else 0
    ps = config.page_size
    scratch = scratch_bytes(components, ps, scratch_units(config))
    groups = [
        _Group("kv_capacity_tokens", config.kv_capacity_tokens, row_bytes(TOKEN), ps, "kv_capacity_tokens" in fixed),
        _Group("swa_capacity_tokens", config.swa_capacity_tokens or config.kv_capacity_tokens, row_bytes(WINDOW), ps,
               "swa_capacity_tokens" in fixed),
        _Group("mamba_slots", config.mamba_slots, row_bytes(SLOT) * (1 + ckpt_each), 1, "mamba_slots" in fixed),
    ]
    return [g for g in groups if g.unit_bytes], ckpt_fixed, scratch


def capacities(components: tuple[ComponentSpec, ...], config: EngineConfig, budget: int,
               why: str = "") -> dict[str, int]:
    """Capacity fields (config.CAPACITY_FIELDS the model uses) that fit `budget` bytes of pools, in
    the flags' proportions, explicit ones kept. Raises HyraxInputError when they cannot."""
    groups, ckpt, scratch = _groups(components, config)
    fixed_bytes = ckpt + scratch + sum(-(-g.value // g.step) * g.step * g.unit_bytes for g in groups if g.fixed)
    flexible = [g for g in groups if not g.fixed]
    if fixed_bytes > budget:
        named = ", ".join(f"--{g.field.replace('_', '-')} {g.value} ({g.value * g.unit_bytes / GiB:.3f} GiB)"
                          for g in groups if g.fixed)
        if ckpt:
            named += f", --mamba-checkpoint-slots {config.mamba_checkpoint_slots} ({ckpt / GiB:.3f} GiB)"
        if scratch:
            named += f", the CUDA-graph padding units ({scratch / GiB:.3f} GiB)"
        raise HyraxInputError(f"{why or f'the pools have {budget / GiB:.3f} GiB'}; the capacities set explicitly "
                              f"need {fixed_bytes / GiB:.3f} GiB: {named}")
    out = {g.field: g.value for g in groups if g.fixed}
    if not flexible:
        return out
    scale = (budget - fixed_bytes) / sum(g.value * g.unit_bytes for g in flexible)
    for g in flexible:
        out[g.field] = int(g.value * scale) // g.step * g.step
        if out[g.field] < g.step:
            smallest = fixed_bytes + sum(f.step * f.unit_bytes for f in flexible)
            raise HyraxInputError(f"{why or f'the pools have {budget / GiB:.3f} GiB'}, too little for even one "
                                  f"{'page' if g.step > 1 else 'slot'} of {g.field.replace('_', '-')} "
                                  f"(the smallest pools need {smallest / GiB:.3f} GiB); raise "
                                  f"--gpu-memory-fraction or lower the explicit capacities, --max-batch-tokens "
                                  f"or --max-running (they set the activation peak)")
    return out


def measured_capacities(model, config: EngineConfig, query: MemoryQuery | None = None, rank: int = 0,
                        device: torch.device | str = "cpu", broadcast=None) -> tuple[dict[str, int], Measurement]:
    """One rank's view: the capacities its device's memory allows, and what it measured.
    `query` None: the device's own (CUDA only)."""
    query = query if query is not None else memory_query(device)
    m = measure(model, config, query, rank, device, broadcast)
    return capacities(model.components, config, m.budget, m.describe()), m


def sized_config(model, config: EngineConfig, query: MemoryQuery | None = None, rank: int = 0,
                 device: torch.device | str = "cpu", broadcast=None) -> tuple[EngineConfig, Measurement]:
    """`config` with its capacities sized from `device`'s memory (one rank: the in-process engine)."""
    caps, m = measured_capacities(model, config, query, rank, device, broadcast)
    return with_capacities(config, caps), m


def with_capacities(config: EngineConfig, caps: dict[str, int]) -> EngineConfig:
    """`config` with these capacities; the sizing is done (ranks built from it do not measure)."""
    return dataclasses.replace(config, gpu_memory_fraction=None, **caps)


def agree(per_rank: list[dict[str, int]]) -> dict[str, int]:
    """The capacities every rank can hold: the smallest of each over the ranks."""
    return {f: min(r[f] for r in per_rank) for f in per_rank[0]}
