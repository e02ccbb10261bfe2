"""--gpu-memory-fraction (issue 18): pools sized from free device memory after a profiling
forward measured the activation peak, in the proportions of the capacity flags, explicit
flags kept; impossible budgets are errors naming the numbers. The device is a recording
stand-in for the memory query (the same protocol CUDA implements), so all of the sizing runs
on the CPU; the profile is a real forward, watched by a hook on the model."""
from __future__ import annotations

import argparse
import dataclasses
import gc
import weakref

import pytest
import torch

from engine_helpers import BASE_CONFIG, HYBRID, greedy, make_prompts, reference_outputs, run_requests, tiny_model
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.engine.local import engine_for_model
from hyrax.actors.engine.memory_budget import agree, capacities, memory_query
from hyrax.actors.model.components import SLOT, TOKEN, WINDOW
from hyrax.actors.model.errors import HyraxInputError
from hyrax.cluster.engine_args import add_engine_args, engine_config_from_args
from hyrax.testing.memory import StandInMemory

MiB = 2**20


class StandInDevice(StandInMemory):
    """The test-only stand-in device (`total` bytes, `used` taken, a profile peaking at `peak`),
    which also records the model's forwards between start_peak and peak_since_start."""

    def __init__(self, total: int, used: int, peak: int, model=None, oom_above_tokens: int = 0):
        super().__init__(total, used, peak)
        self.oom_above_tokens = oom_above_tokens  # a profiling forward this big runs out of memory
        self.profiled: list[tuple[int, int]] = []  # (sequences, tokens) of each forward while measuring
        self._measuring = False
        self._hook = model.register_forward_pre_hook(self._forward) if model is not None else None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        if self._hook is not None:
            self._hook.remove()  # the model is shared by other tests

    def _forward(self, module, args):
        if self._measuring:
            batch = args[0]
            self.profiled.append((batch.num_seqs, int(batch.q_lens.sum())))
            if self.oom_above_tokens and self.profiled[-1][1] > self.oom_above_tokens:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    def start_peak(self):
        super().start_peak()
        self._measuring = True

    def peak_since_start(self):
        self._measuring = False
        return super().peak_since_start()


def _bytes_at(comps, config) -> int:
    """Device bytes of the pools these capacities make (checkpoint pools included)."""
    def rb(kind):
        return sum(c.row_bytes for c in comps if c.kind == kind)
    ps = config.page_size
    kv = -(-config.kv_capacity_tokens // ps) * ps
    swa = -(-(config.swa_capacity_tokens or config.kv_capacity_tokens) // ps) * ps
    return kv * rb(TOKEN) + swa * rb(WINDOW) + (config.mamba_slots + config.checkpoint_slots) * rb(SLOT)


def _config(**kw) -> EngineConfig:
    return dataclasses.replace(EngineConfig(**BASE_CONFIG), **kw)


def test_pools_fill_the_fraction_left_after_weights_and_activations_keeping_the_flags_ratio():
    model = tiny_model(HYBRID, torch.float64)
    comps = model.components
    flags = _config()
    at_flags = _bytes_at(comps, flags)
    total, used, peak, fraction = 1000 * MiB, 100 * MiB, 7 * MiB, 0.5
    budget = int(fraction * total) - used - peak
    with StandInDevice(total, used, peak, model) as device:
        e = engine_for_model(model, _config(gpu_memory_fraction=fraction), memory=device)
    # the profile ran between start_peak and peak_since_start, before the device was read
    assert device.calls == ["start_peak", "peak_since_start", "free_total"], device.calls
    assert device.profiled, "no profiling forward ran"
    scale = budget / at_flags
    c = e.config
    assert c.kv_capacity_tokens == int(flags.kv_capacity_tokens * scale) // 4 * 4
    assert c.swa_capacity_tokens == c.kv_capacity_tokens  # swa follows kv, as with the flags
    assert c.mamba_slots == int(flags.mamba_slots * scale)
    assert c.checkpoint_slots == 3 * c.mamba_slots
    got = _bytes_at(comps, c)
    assert got <= budget and got > 0.99 * budget, (got, budget)
    assert e.alloc["full_kv"].capacity == c.kv_capacity_tokens // 4 and e.alloc["mamba_ssm"].capacity == c.mamba_slots
    # and the engine serves with them
    prompts = make_prompts(3, seed=2)
    assert run_requests(e, prompts, greedy(8)) == reference_outputs(HYBRID, torch.float64, prompts, 8)


def test_the_profile_runs_the_biggest_steps_the_scheduler_can_make():
    model = tiny_model(HYBRID, torch.float64)
    with StandInDevice(1000 * MiB, 0, 0, model) as device:
        engine_for_model(model, _config(gpu_memory_fraction=0.1, max_running=5, deterministic=False), memory=device)
    # max_batch_tokens=32 in 4 chunks of 8, and 5 single tokens
    assert device.profiled == [(4, 32), (5, 5)], device.profiled


def test_an_explicit_capacity_is_kept_and_the_rest_share_what_is_left():
    comps = tiny_model(HYBRID, torch.float64).components
    flags = _config(kv_capacity_tokens=512, fixed_capacities=("kv_capacity_tokens",))
    at_flags = _bytes_at(comps, flags)
    caps = capacities(comps, flags, 4 * at_flags)
    assert caps["kv_capacity_tokens"] == 512
    sized = dataclasses.replace(flags, **caps)
    assert caps["mamba_slots"] > 4 * flags.mamba_slots  # the others took kv's share of the growth
    # swa follows the flags' ratio to mamba: both grew by the same factor
    assert caps["swa_capacity_tokens"] / 512 == pytest.approx(caps["mamba_slots"] / flags.mamba_slots, rel=0.02)
    assert _bytes_at(comps, sized) <= 4 * at_flags


def test_impossible_budgets_are_errors_naming_the_numbers():
    comps = tiny_model(HYBRID, torch.float64).components
    big = _config(kv_capacity_tokens=10**6, fixed_capacities=("kv_capacity_tokens",))
    with pytest.raises(HyraxInputError, match=r"--kv-capacity-tokens 1000000 \(.* GiB\)"):
        capacities(comps, big, 10 * MiB)
    with pytest.raises(HyraxInputError, match="too little for even one"):
        capacities(comps, _config(), 1000)
    model = tiny_model(HYBRID, torch.float64)
    # the device is already fuller than the fraction: the message says what was measured
    device = StandInDevice(1000 * MiB, 900 * MiB, 5 * MiB)
    with pytest.raises(HyraxInputError, match=r"gpu-memory-fraction 0.5 of 0.98 GiB.*0.88 GiB in use"):
        engine_for_model(model, _config(gpu_memory_fraction=0.5), memory=device)


def test_a_profile_that_runs_out_of_memory_names_the_flags_that_set_it():
    model = tiny_model(HYBRID, torch.float64)
    with StandInDevice(1000 * MiB, 0, 0, model, oom_above_tokens=16) as device:
        with pytest.raises(HyraxInputError, match=r"profiling forward .*--max-batch-tokens 32.*ran out of device memory"):
            engine_for_model(model, _config(gpu_memory_fraction=0.5, deterministic=False), memory=device)


def test_without_cuda_or_a_query_the_fraction_is_an_error_never_ignored():
    with pytest.raises(HyraxInputError, match="runs on cpu"):
        memory_query("cpu")
    with pytest.raises(HyraxInputError, match="runs on cpu"):
        engine_for_model(tiny_model(HYBRID, torch.float64), _config(gpu_memory_fraction=0.9))


@pytest.mark.parametrize("bad", [0, -0.1, 1.5])
def test_the_fraction_is_validated(bad):
    with pytest.raises(HyraxInputError, match="gpu-memory-fraction"):
        EngineConfig(gpu_memory_fraction=bad)
    with pytest.raises(HyraxInputError, match="fixed_capacities"):
        EngineConfig(fixed_capacities=("page_size",))


def test_ranks_agree_on_the_smallest_capacities():
    assert agree([{"kv_capacity_tokens": 64, "mamba_slots": 9}, {"kv_capacity_tokens": 48, "mamba_slots": 12}]) \
        == {"kv_capacity_tokens": 48, "mamba_slots": 9}


def _cli(*argv: str) -> EngineConfig:
    p = argparse.ArgumentParser()
    add_engine_args(p)
    return engine_config_from_args(p.parse_args(list(argv)))


def test_the_cli_flag_and_which_capacities_were_given_explicitly():
    c = _cli("--gpu-memory-fraction", "0.8", "--kv-capacity-tokens", "4096")
    assert c.gpu_memory_fraction == 0.8 and c.fixed_capacities == ("kv_capacity_tokens",)
    assert c.kv_capacity_tokens == 4096 and c.mamba_slots == EngineConfig.mamba_slots
    plain = _cli()
    assert plain.gpu_memory_fraction is None and plain.fixed_capacities == ()
    assert (plain.kv_capacity_tokens, plain.mamba_slots) == (EngineConfig.kv_capacity_tokens, EngineConfig.mamba_slots)
    with pytest.raises(HyraxInputError, match="gpu-memory-fraction must be in"):
        _cli("--gpu-memory-fraction", "1.5")


def test_the_scratch_units_of_cuda_graph_decode_are_counted_in_the_budget():
    """`--captured-decode cuda_graphs` pools keep a scratch page of each paged kind and a scratch
    slot past their capacity (engine/pools.py): pools that exactly fill the budget without them
    do not fit with them, and the error names them."""
    from hyrax.actors.engine.pools import pool_bytes, pool_sizes_for

    comps = tiny_model(HYBRID, torch.float64).components
    fixed = ("kv_capacity_tokens", "swa_capacity_tokens", "mamba_slots")
    plain = _config(kv_capacity_tokens=512, swa_capacity_tokens=256, mamba_slots=4, fixed_capacities=fixed)
    budget = pool_bytes(comps, pool_sizes_for(comps, plain))
    assert capacities(comps, plain, budget) == {"kv_capacity_tokens": 512, "swa_capacity_tokens": 256, "mamba_slots": 4}
    graphs = dataclasses.replace(plain, captured_decode="cuda_graphs")
    with pytest.raises(HyraxInputError, match="the CUDA-graph padding units"):
        capacities(comps, graphs, budget)
    assert capacities(comps, graphs, pool_bytes(comps, pool_sizes_for(comps, graphs))) == capacities(comps, plain, budget)


class PoolWatch(StandInDevice):
    """The stand-in device, also keeping weak references to the pools the profiling forwards
    ran over and, when the device is read, how many of them were still alive."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pools: list[weakref.ref] = []
        self.alive_at_read: int | None = None

    def _forward(self, module, args):
        super()._forward(module, args)
        if self._measuring:
            self.pools += [weakref.ref(t) for t in args[1].values()]

    def free_total(self):
        self.alive_at_read = sum(r() is not None for r in self.pools)
        return super().free_total()


def test_the_profile_pools_are_freed_before_the_device_is_read():
    """The profile runs on throw-away pools and the device's free memory is read right after they
    are dropped: on CUDA, pools still alive then count as memory in use (empty_cache cannot give
    back blocks a live tensor holds), and the real pools come out that much smaller. They must go
    by reference counting alone: the collector is off here, as it is most of the time between two
    of its runs (a runtime that keeps a bound method of itself was alive at the read)."""
    model = tiny_model(HYBRID, torch.float64)
    gc.collect()
    gc.disable()
    try:
        with PoolWatch(1000 * MiB, 0, 0, model) as device:
            engine_for_model(model, _config(gpu_memory_fraction=0.1), memory=device)
    finally:
        gc.enable()
    assert device.pools, "no profiling forward ran"
    assert device.alive_at_read == 0, f"{device.alive_at_read} of {len(device.pools)} profile pools alive"
