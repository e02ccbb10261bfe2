"""Host memory that a rank's `cpu_tensor` backups reuse.

A backup takes a buffer, discarding the backup gives it back, and the next backup of a
similar size takes it again. On a CUDA rank the buffers are pinned, so device copies into
them can run asynchronously; allocating a fresh pinned tensor per backup instead leaves
every freed one in torch's caching host allocator, which never returns it to the OS, so
the peak of all backups ever taken became permanent locked memory. Here the locked total
follows the live backups, plus at most `max_idle_bytes` kept for reuse.
"""
from __future__ import annotations

import math

import torch

MIN_BUFFER_BYTES = 4096


def size_class(nbytes: int) -> int:
    """The buffer size that serves `nbytes`: the next power of two, at least 4 KiB."""
    return max(MIN_BUFFER_BYTES, 1 << (nbytes - 1).bit_length())


class HostBuffers:
    def __init__(self, pin: bool, max_idle_bytes: int = 1 << 30):
        self.pin = pin  # only where CUDA is available: pinning needs the CUDA driver
        self.max_idle_bytes = max_idle_bytes
        self._idle: dict[int, list[torch.Tensor]] = {}  # size class -> free uint8 buffers
        self._lent: dict[int, torch.Tensor] = {}  # data_ptr of a lent view -> its buffer
        self.idle_bytes = 0
        self.allocations = 0  # buffers allocated so far (a reused one does not count)

    def take(self, shape: tuple[int, ...] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A contiguous host tensor of `shape` and `dtype` (uninitialised), backed by a pooled
        buffer until it is given back."""
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        size = size_class(nbytes)
        free = self._idle.get(size)
        if free:
            buf = free.pop()
            self.idle_bytes -= size
        else:
            buf = torch.empty(size, dtype=torch.uint8, pin_memory=self.pin)
            self.allocations += 1
        view = buf[:nbytes].view(dtype).view(shape)
        self._lent[view.data_ptr()] = buf
        return view

    def give(self, t: torch.Tensor) -> None:
        """Return the buffer behind `t` (a tensor `take` returned; others are ignored). The
        caller must not use `t` afterwards: the next `take` may hand out the same bytes."""
        buf = self._lent.pop(t.data_ptr(), None) if t.numel() else None
        if buf is None:
            return
        if self.idle_bytes + buf.numel() > self.max_idle_bytes:
            return  # dropped: the memory goes back to the allocator
        self._idle.setdefault(buf.numel(), []).append(buf)
        self.idle_bytes += buf.numel()

    @property
    def lent(self) -> int:
        return len(self._lent)
