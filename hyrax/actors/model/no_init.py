"""Building a model whose weights a checkpoint is about to overwrite, without initialising them.

`torch.nn.Linear`, `Conv1d` and `Embedding` fill their weights with random numbers when they are
built. For a model loaded from a checkpoint that is wasted work (1-2 s for a 100M-parameter
model on two cores), and on the meta device it is worse: `normal_` there runs through torch's
Python reference implementations, whose first use imports them (4-5 s per process, paid by
every rank actor). Inside `weights_left_uninitialised()` those modules skip their
`reset_parameters`, in this thread only; the loader then checks that every weight was read.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from torch import nn

_state = threading.local()
_INITIALISED_MODULES = (nn.Linear, nn.Conv1d, nn.Embedding)
_installed = False
_install_lock = threading.Lock()


def _skippable(reset):
    def reset_parameters(self, *args, **kwargs):
        if getattr(_state, "depth", 0):
            return None
        return reset(self, *args, **kwargs)

    reset_parameters.__wrapped__ = reset
    return reset_parameters


def _install() -> None:
    global _installed
    with _install_lock:
        if _installed:
            return
        for cls in _INITIALISED_MODULES:
            cls.reset_parameters = _skippable(cls.reset_parameters)
        _installed = True


@contextmanager
def weights_left_uninitialised():
    """Modules built in this block (this thread) keep whatever memory their weights got."""
    _install()
    _state.depth = getattr(_state, "depth", 0) + 1
    try:
        yield
    finally:
        _state.depth -= 1
