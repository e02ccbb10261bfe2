"""The CUDA memory query of --gpu-memory-fraction (memory_budget.CudaMemory), on the CPU with
stand-ins for torch.cuda: every call names its GPU by index. The in-process engine's device is
"cuda" (no index), and torch 2.4's `torch.cuda.mem_get_info` refuses a device without one
("Expected a torch.device with a specified index"; later versions take the current device)."""
from __future__ import annotations

import torch
from torch._utils import _get_device_index

from hyrax.actors.engine import memory_budget


class Torch24Cuda:
    """What CudaMemory calls, answering as torch 2.4 does for a device argument."""

    def __init__(self):
        self.asked: list = []

    def current_device(self) -> int:
        return 0

    def synchronize(self, device=None) -> None:
        self.asked.append(("synchronize", _get_device_index(device, optional=True)))

    def empty_cache(self) -> None:
        pass

    def mem_get_info(self, device=None) -> tuple[int, int]:
        self.asked.append(("mem_get_info", _get_device_index(device)))  # 2.4: no `optional`
        return 10, 80

    def reset_peak_memory_stats(self, device=None) -> None:
        self.asked.append(("reset_peak_memory_stats", _get_device_index(device, optional=True)))

    def memory_allocated(self, device=None) -> int:
        return 5

    def max_memory_allocated(self, device=None) -> int:
        return 7


def test_the_query_of_an_index_less_cuda_device_names_the_current_gpu(monkeypatch):
    cuda = Torch24Cuda()
    for name in ("current_device", "synchronize", "empty_cache", "mem_get_info", "reset_peak_memory_stats",
                 "memory_allocated", "max_memory_allocated"):
        monkeypatch.setattr(torch.cuda, name, getattr(cuda, name))
    query = memory_budget.memory_query("cuda")
    query.start_peak()
    assert query.peak_since_start() == 2
    assert query.free_total() == (10, 80)
    assert ("mem_get_info", 0) in cuda.asked
