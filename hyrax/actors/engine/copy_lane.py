"""Where a rank's state moves (backup, restore, export, import) run, chosen once per rank.

On the CPU there is one stream of work: a move runs in line. On a GPU the moves run on a copy
stream of their own, ordered with events against the compute stream instead of a device-wide
synchronise: the copy stream waits for what the compute stream has queued so far (the rows the
last step wrote), and the compute stream's next kernels wait for the moves (a restore's rows
must be in place before a step reads them). A move's own host read (its state hashes) waits
only for the copy stream, so the host never waits on unrelated compute work, and the pinned
host buffers a move copies into are complete when that read returns.
"""
from __future__ import annotations

from contextlib import contextmanager, nullcontext

import torch


class InlineLane:
    """CPU: nothing to order."""

    def moving(self):
        return nullcontext()


class CudaCopyLane:
    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device)

    @contextmanager
    def moving(self):
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # an event: the rows written by the work queued so far
        with torch.cuda.stream(self.stream):
            yield
        compute.wait_stream(self.stream)  # the next step runs after the moves' writes


def copy_lane(device: torch.device) -> InlineLane | CudaCopyLane:
    return CudaCopyLane(device) if device.type == "cuda" else InlineLane()
