"""The rank's copy stream (hyrax/actors/engine/copy_lane.py) on a GPU (skipped without CUDA): a
move sees the rows that compute work queued before it writes, and the compute work queued after
it sees the rows the move wrote, with no device-wide synchronise in between."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.engine.copy_lane import CudaCopyLane
from hyrax.actors.engine.host_buffers import HostBuffers

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

N = 1 << 20


def test_moves_are_ordered_after_queued_compute_and_before_the_next():
    dev = torch.device("cuda", torch.cuda.current_device())
    lane = CudaCopyLane(dev, HostBuffers(pin=True))
    pool = torch.zeros(2, N, device=dev)
    a = torch.randn(2048, 2048, device=dev)
    for _ in range(8):  # long enough that an unordered copy would read zeros
        a = torch.tanh(a @ a)
    pool[0].copy_(a.flatten()[:N])
    host = torch.empty(N, pin_memory=True)
    with lane.moving():
        assert torch.cuda.current_stream(dev) == lane.stream
        host.copy_(pool[0], non_blocking=True)
        lane.stream.synchronize()  # what a move's hash read waits for: its own stream only
    assert torch.equal(host, pool[0].cpu())
    src = torch.randn(N).pin_memory()
    with lane.moving():
        pool[1].copy_(src, non_blocking=True)
    after = pool[1].clone()  # queued on the compute stream after the move: reads what it wrote
    assert torch.equal(after.cpu(), src)  # exact (a sum compared with a tolerance could flake near 0)


def test_a_move_that_raises_still_orders_the_next_compute_work_after_it():
    """A move may raise after queueing writes into the pools (an allocation that fails, a
    refused shard): the compute stream must still wait for what it queued. The copy stream is
    kept busy for about a second; once the compute stream has drained, the copy stream has too
    only if the compute stream waited for it."""
    dev = torch.device("cuda", torch.cuda.current_device())
    lane = CudaCopyLane(dev, HostBuffers(pin=True))
    with pytest.raises(RuntimeError, match="the move failed"):
        with lane.moving():
            torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles on the copy stream
            raise RuntimeError("the move failed")
    torch.cuda.current_stream(dev).synchronize()
    assert lane.stream.query(), "the compute stream did not wait for the failed move's work"
