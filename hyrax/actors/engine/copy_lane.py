"""Where a rank's state moves (backup, restore, export, import) run, chosen once per rank.

On the CPU there is one stream of work: a move runs in line. On a GPU the moves run on a copy
stream of their own, ordered with events against the compute stream instead of a device-wide
synchronise: the copy stream waits for what the compute stream has queued so far (the rows the
last step wrote), and the compute stream's next kernels wait for the moves (a restore's rows
must be in place before a step reads them). A move's own host read (its state hashes) waits
only for the copy stream, so the host never waits on unrelated compute work, and the pinned
host buffers a move copies into are complete when that read returns.

The lane also says where a move's packed buffers (packed_state.py) live. A save gathers rows
into a buffer on the device (`device_words`), hashes it there and keeps it on the host
(`to_host`); a restore brings a kept buffer to the device (`to_device`) and gathers the rows it
wrote into a scratch buffer on the device (`device_words`, given back by `drop`). On the CPU the
device is the host: the buffer a save gathers into is the host buffer it keeps, no copy.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch

from hyrax.actors.engine.host_buffers import HostBuffers
from hyrax.actors.engine.state_hash import ROW_WORDS


class InlineLane:
    """CPU: nothing to order; device buffers are host buffers."""

    def __init__(self, buffers: HostBuffers):
        self.buffers = buffers

    def moving(self):
        return nullcontext()

    def device_words(self, rows: int) -> torch.Tensor:
        """(rows, ROW_WORDS) int64, uninitialised: a host buffer of the pool."""
        return self.buffers.take((rows, ROW_WORDS), torch.int64)

    def to_host(self, words: torch.Tensor) -> torch.Tensor:
        """The host buffer holding `words` (which the caller keeps or gives back): itself."""
        return words

    def to_device(self, words: torch.Tensor) -> torch.Tensor:
        return words

    def drop(self, words: torch.Tensor) -> None:
        """A `device_words` buffer no longer needed."""
        self.buffers.give(words)


class CudaCopyLane:
    def __init__(self, device: torch.device, buffers: HostBuffers):
        self.device = device
        self.buffers = buffers  # pinned
        self.stream = torch.cuda.Stream(device)

    @contextmanager
    def moving(self):
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # an event: the rows written by the work queued so far
        try:
            with torch.cuda.stream(self.stream):
                yield
        finally:  # a move that raised may have queued writes into the pools all the same
            compute.wait_stream(self.stream)  # the next step runs after the moves' writes

    def device_words(self, rows: int) -> torch.Tensor:
        """(rows, ROW_WORDS) int64 in device memory (allocated on the copy stream inside `moving`)."""
        return torch.empty((rows, ROW_WORDS), dtype=torch.int64, device=self.device)

    def to_host(self, words: torch.Tensor) -> torch.Tensor:
        """A pinned host buffer that `words` is copied into, asynchronously on the copy stream:
        complete once the move's host read (its hashes, queued after this) returns."""
        host = self.buffers.take(words.shape, words.dtype)
        host.copy_(words, non_blocking=True)
        return host

    def to_device(self, words: torch.Tensor) -> torch.Tensor:
        return words.to(self.device, non_blocking=True)

    def drop(self, words: torch.Tensor) -> None:
        """Device memory goes back to torch's caching allocator with the tensor (its stream is
        the copy stream, so reuse is ordered after the work queued on it)."""


def copy_lane(device: torch.device, buffers: HostBuffers) -> InlineLane | CudaCopyLane:
    return CudaCopyLane(device, buffers) if device.type == "cuda" else InlineLane(buffers)
