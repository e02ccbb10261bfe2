"""Host synchronisations per decode step (issue 18, finding 4), counted on the CPU by the
device stand-in `hyrax.testing.sync_counter` around `RankRuntime.execute`.

A decode step may make the host wait only a constant number of times, whatever the batch
and the depth: the step's metadata goes over in one non-blocking copy, no layer copies or
masks anything whose size only the device knows, and sampling reads the tokens once.
Before this, a decode step of the 4-layer hybrid (2 attention layers) counted 26 (SDPA), 30
(flash adapter) and 32 (top-k/top-p sampling); 32 and 40 with 8 layers: three more per
attention layer (five with flash) and five more per paged component.
"""
from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from engine_helpers import HYBRID, make_engine, tiny_config, tiny_model
from flash_reference import varlen_paged_reference
import hyrax.actors.engine.sampler as sampler_module
import hyrax.actors.model.batch as batch_module
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model.attn_backends import FlashPaged, SdpaPaged
from hyrax.actors.model.hybrid import HybridModel
from hyrax.testing.sync_counter import Counts, Kind, SyncCounter, rank_counter


@pytest.fixture(autouse=True)
def _cuda_route(monkeypatch):
    """The step's metadata takes the route it takes on CUDA (packed, one copy), not the CPU's,
    and the sampler reads nothing back early, as on CUDA."""
    monkeypatch.setattr(batch_module, "PACK_ON_CPU", True)
    monkeypatch.setattr(sampler_module, "READ_BACK_ON_CPU", False)


GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
RANDOM = SamplingParams(max_tokens=6, temperature=0.8, top_k=5, top_p=0.9, seed=3, ignore_eos=True)
LOGPROBS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=3)
# every logit processing at once; min_tokens == max_tokens keeps token 7 masked at every draw
PENALISED = SamplingParams(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True, repetition_penalty=1.2,
                           frequency_penalty=0.5, presence_penalty=0.3, logit_bias=((5, 2.0), (9, -1.0)),
                           stop_token_ids=(7,), min_tokens=6)


def _deeper_model() -> HybridModel:
    """The hybrid layout twice over: 8 layers, twice the attention and Mamba2 layers."""
    cfg = tiny_config(HYBRID)
    return HybridModel(dataclasses.replace(cfg, layer_types=cfg.layer_types * 2))


def decode_step_counts(model: HybridModel, batch: int, sampling: SamplingParams, flash: bool) -> Counts:
    """The counts of the last step in which all `batch` requests decode one token (batched)."""
    model = copy.deepcopy(model)
    engine = make_engine(model, deterministic=False, **({"page_size": 16} if flash else {}))
    rank = engine.executor.rank
    counter = rank_counter(rank)
    for layer in rank.model.model.layers:  # the paths a device has (the CPU's C kernels are not among them)
        if hasattr(layer, "mamba"):
            layer.mamba.native_kernels = layer.mamba.native_step = False
        if hasattr(layer, "self_attn"):
            # flash: the CPU reference kernel stands in for the device kernel, its own ops not counted
            layer.self_attn.backend = FlashPaged(counter.opaque(varlen_paged_reference)) if flash else SdpaPaged()
    plain, counted = rank.execute, counter.wrap(rank.execute)

    def execute(plan):  # only the steps in which every request decodes are counted (counting is slow)
        decode_only = plan.num_rows == batch and all(len(e.token_ids) == 1 for e in plan.entries)
        return (counted if decode_only else plain)(plan)
    rank.execute = execute
    for i in range(batch):
        engine.add_request([(7 * i + j) % 90 + 1 for j in range(3 + i % 5)], sampling)
    while engine.has_unfinished():
        engine.step()
    assert counter.calls, "no step decoded every request at once"
    return counter.calls[-1]


@pytest.mark.parametrize("flash", [False, True], ids=["sdpa", "flash"])
@pytest.mark.parametrize("sampling,reads", [(GREEDY, 1), (RANDOM, 1), (PENALISED, 1), (LOGPROBS, 2)],
                         ids=["greedy", "top_k_top_p", "penalties", "logprobs"])
def test_decode_step_syncs_are_few_and_independent_of_batch_and_layers(flash, sampling, reads):
    one = decode_step_counts(tiny_model(HYBRID), 1, sampling, flash)
    many = decode_step_counts(tiny_model(HYBRID), 16, sampling, flash)
    deep = decode_step_counts(_deeper_model(), 16, sampling, flash)
    report = f"batch 1:\n{one.table()}\nbatch 16:\n{many.table()}\n8 layers, batch 16:\n{deep.table()}"
    assert one.syncs == reads, report  # only the reads: a decode step's logits are used whole, no upload blocks
    assert one.syncs == many.syncs == deep.syncs, report
    assert one.of(Kind.READ) == reads, report  # the tokens (and the logprobs), once for the batch
    # the step's metadata, the logit processing's numbers, the sampled rows' parameters
    assert many.of(Kind.ASYNC_UPLOAD) <= 3, report


def test_the_counter_counts_what_would_make_the_host_wait():
    """The stand-in itself: each kind of op it names is counted, host work is free."""
    weight = torch.arange(6.0)
    counter = SyncCounter([weight])

    def step():
        host = torch.tensor([1, 0, 1])  # host data: free
        assert int(host.sum()) == 2 and host.tolist() == [1, 0, 1] and bool(host[host > 0].numel())
        dev = host.to("cpu")  # a blocking upload
        late = torch.tensor([2], device="cpu")  # Python data straight to the device: an upload
        soon = torch.arange(3).to("cpu", non_blocking=True)  # not a sync
        x = weight[:3] * dev + soon + late
        x.sum().item()  # a read
        weight[weight > 2]  # a boolean mask: the size is on the device
        weight[[0, 1]]  # a list index: an upload
        weight[:3] + torch.arange(3)  # a host operand: an upload
        x.nonzero()  # data-dependent shape
        return x.tolist()  # a read

    counter.wrap(step)()
    (got,) = counter.calls
    assert [e.kind for e in got.events] == [
        Kind.UPLOAD, Kind.UPLOAD, Kind.ASYNC_UPLOAD, Kind.READ, Kind.SHAPE, Kind.UPLOAD, Kind.UPLOAD,
        Kind.SHAPE, Kind.READ], got.table()
    assert got.syncs == 8


def test_rope_frequencies_move_with_the_model():
    """RoPE's inv_freq is a buffer of the model, so `model.to(device)` takes it along and a
    step never copies it from the host."""
    model = copy.deepcopy(tiny_model(HYBRID)).to("meta")
    assert model.rope.inv_freq.device.type == "meta"
    assert "rope_freqs.inv_freq" not in model.state_dict()  # checkpoints do not carry it
