"""A rank runs on the GPU Ray assigned it (made the current CUDA device), not on cuda:0, and on
the CPU when it was assigned none. Ray's answers are injected: this machine has no GPU."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.rank import place_rank


def placed(gpu_ids, visible, cuda_available=True):
    current = []
    return place_rank(gpu_ids, visible, cuda_available, set_device=current.append), current


@pytest.mark.parametrize("gpu_ids,visible,index", [
    (["3"], "3", 0),  # Ray narrowed CUDA_VISIBLE_DEVICES to the rank's GPU
    ([1], "1", 0),  # ids may come back as ints
    (["3"], "0,1,2,3", 3),  # RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES: the process sees every GPU
    (["GPU-5b1c"], "GPU-9a0e,GPU-5b1c", 1),  # visible devices named by UUID
    (["2"], None, 2),  # nothing narrowed: the physical id is the index
])
def test_a_rank_takes_the_gpu_ray_assigned_it(gpu_ids, visible, index):
    device, current = placed(gpu_ids, visible)
    assert device == torch.device("cuda", index)
    assert current == [device]  # torch.cuda.set_device ran, so cuda ops default to it


def test_a_rank_assigned_no_gpu_runs_on_the_cpu_even_on_a_gpu_host():
    assert placed([], "0,1", cuda_available=True) == (torch.device("cpu"), [])


def test_an_assigned_gpu_that_torch_cannot_use_is_a_clear_error():
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        placed(["0"], "0", cuda_available=False)
    with pytest.raises(RuntimeError, match="does not list"):
        placed(["4"], "0,1")
