"""`cpu_tensor` backups reuse host buffers (pinned on a CUDA rank) instead of allocating a
fresh one per backup: the locked memory follows the live backups, not every backup ever
taken. On CPU the same pool runs unpinned, so its reuse is tested here."""
from __future__ import annotations

import torch

from engine_helpers import greedy, make_engine, make_prompts, run_requests, tiny_model
from hyrax.actors.engine.host_buffers import HostBuffers, size_class


def test_a_given_back_buffer_serves_the_next_backup_of_its_size_class():
    pool = HostBuffers(pin=False)
    a = pool.take((2, 3, 100), torch.float32)  # 2400 bytes -> the 4 KiB class
    assert a.shape == (2, 3, 100) and a.dtype == torch.float32 and a.is_contiguous()
    ptr = a.data_ptr()
    pool.give(a)
    b = pool.take((5, 200), torch.bfloat16)  # 2000 bytes: the same class
    assert b.data_ptr() == ptr and pool.allocations == 1
    c = pool.take((3000,), torch.uint8)  # b is still lent: never handed out twice
    assert c.data_ptr() != ptr and pool.allocations == 2
    d = pool.take((5000,), torch.uint8)  # the 8 KiB class
    assert pool.allocations == 3 and pool.lent == 3
    for t in (b, c, d):
        pool.give(t)
    assert pool.lent == 0 and pool.idle_bytes == 4096 + 4096 + 8192


def test_taken_tensors_hold_what_is_written_to_them():
    pool = HostBuffers(pin=False)
    x = torch.arange(24, dtype=torch.float64).view(2, 3, 4)
    t = pool.take(x.shape, x.dtype)
    t.copy_(x)
    other = pool.take(x.shape, x.dtype)
    other.fill_(-1)
    assert torch.equal(t, x)


def test_idle_memory_is_capped_and_foreign_tensors_are_ignored():
    pool = HostBuffers(pin=False, max_idle_bytes=8192)
    bufs = [pool.take((4096,), torch.uint8) for _ in range(3)]
    for t in bufs:
        pool.give(t)
    assert pool.idle_bytes == 8192 and pool.lent == 0  # the third went back to the allocator
    pool.give(torch.zeros(10))  # not from the pool: nothing happens
    empty = pool.take((0, 4), torch.float32)
    pool.give(empty)
    assert empty.shape == (0, 4) and pool.idle_bytes == 8192
    assert size_class(1) == 4096 and size_class(4097) == 8192 and size_class(1 << 20) == 1 << 20


def test_cpu_tensor_retractions_reuse_a_few_buffers_and_return_all():
    """Forced retraction every 3 steps: dozens of backups, a handful of allocations, and
    every buffer back in the pool once the requests are done."""
    e = make_engine(tiny_model("full_swa_mamba"), forced_retraction_interval=3, retraction_backup="cpu_tensor")
    run_requests(e, make_prompts(6, seed=2), greedy(24))
    rank = e.executor.rank
    backups = e.stats.summary()["retractions"]
    assert backups >= 8
    assert rank.buffers.lent == 0
    components = len(rank.components)
    # 9 backups x 4 components took 5 buffers (a fresh buffer per backup: 36)
    assert rank.buffers.allocations <= 2 * components < backups * components, (rank.buffers.allocations, backups)
