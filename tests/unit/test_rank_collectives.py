"""Every tensor a rank hands to a collective lives on the device its group's backend serves.

gloo accepts CPU and CUDA tensors alike, so a CPU run cannot notice a CPU tensor sent to an
NCCL group (which takes CUDA tensors only). These tests put a recording stand-in in place of
torch.distributed's collectives that refuses a tensor on any other device than the one it
serves. A GPU rank is emulated on a CPU-only machine by a rank and a group on the `meta`
device: a device that is not the CPU, whose tensors have shape, dtype and device but no data
(the cheap stand-in; torch's FakeTensorMode could emulate "cuda" itself but takes ~20 s to set up).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hyrax.actors.rank import ReplicaGroup


class WrongDevice(RuntimeError):
    pass


class RecordingGroup:
    """Stands in for a process group: records (op, device, shape) of each collective, refuses
    tensors off `device`, and broadcasts `rank0_tokens` (what rank 0 sampled) into the tensor."""

    def __init__(self, device: str, rank0_tokens: list[int] | None = None):
        self.device = torch.device(device)
        self.rank0_tokens = rank0_tokens
        self.calls: list[tuple[str, torch.device, tuple[int, ...]]] = []

    def _take(self, op: str, t: torch.Tensor) -> None:
        if t.device != self.device:
            raise WrongDevice(f"{op}: tensor on {t.device}, the group serves {self.device}")
        self.calls.append((op, t.device, tuple(t.shape)))

    def broadcast(self, t, src, group=None, async_op=False):
        self._take("broadcast", t)
        if self.rank0_tokens is not None:
            t.copy_(torch.tensor(self.rank0_tokens, dtype=t.dtype))

    def all_reduce(self, t, op=None, group=None, async_op=False):
        self._take("all_reduce", t)
        t.mul_(2)  # two ranks holding the same partial sum


@pytest.fixture
def install(monkeypatch):
    def _install(group: RecordingGroup) -> RecordingGroup:
        monkeypatch.setattr(dist, "broadcast", group.broadcast)
        monkeypatch.setattr(dist, "all_reduce", group.all_reduce)
        return group
    return _install


def test_gloo_rank_broadcasts_and_reduces_cpu_tensors(install):
    group = install(RecordingGroup("cpu", rank0_tokens=[7, 8, 9]))
    rank = ReplicaGroup(torch.device("cpu"))
    assert rank.broadcast_tokens([0, 0, 0]) == [7, 8, 9]  # a non-zero rank adopts rank 0's tokens
    partial = torch.ones(2, 3)
    assert rank.all_reduce(partial) is partial and partial.eq(2).all()
    assert group.calls == [("broadcast", torch.device("cpu"), (3,)), ("all_reduce", torch.device("cpu"), (2, 3))]


def test_gpu_rank_hands_the_group_only_tensors_on_its_device(install):
    """A rank off the CPU broadcasts its sampled tokens on its own device (they were a CPU
    tensor: NCCL failed the first sampling step of every TP >= 2 deployment on GPUs)."""
    meta = torch.device("meta")
    group = install(RecordingGroup("meta"))
    rank = ReplicaGroup(meta)
    # a meta tensor holds no values, so reading the broadcast tokens back is the one step that
    # cannot run here; the collective has run (or refused the tensor) before it
    with pytest.raises(NotImplementedError, match="meta tensor"):
        rank.broadcast_tokens([3, 1, 4])
    rank.all_reduce(torch.zeros(2, 5, device=meta))
    assert group.calls == [("broadcast", meta, (3,)), ("all_reduce", meta, (2, 5))]
