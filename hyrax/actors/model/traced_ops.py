"""The C kernels as torch operators (`torch.ops.hyrax.*`), for a torch.compile'd forward
(captured_decode.py): traced code cannot hand a kernel its tensors' addresses, so a compiled
decode step calls each kernel as one opaque node of its graph, and the operator, run with
real tensors, calls the kernel.

Defined through `torch.library.Library` with an explicit schema and a CPU implementation, not
`torch.library.custom_op`: the latter wraps every call in Python layers (autograd, mutation
bookkeeping) that cost ~130 us a call here against ~17 us for the plain dispatcher route
(measured, one thread, the demo's Mamba2 decode step at 16 sequences: 50 us direct, 190 us
through a custom_op, 77 us through a Library operator). A decode forward calls these six times.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch.torch_version import TorchVersion

log = logging.getLogger(__name__)

_LIBRARY: torch.library.Library | None = None  # kept alive: operators live as long as it does

# Whether torch.compile runs an operator that writes into its arguments (`Tensor(a!)`) right when
# they are views at an offset into the graph's inputs, as a compiled decode step hands the Mamba2
# operator one layer's rows of each pool. torch 2.4's to 2.6's inductor copies such a view before
# the call and back after, and its copy starts at the view's offset counted twice: the kernel
# steps the next layer's state, or memory past the pool (NaN states and logits; seen on 2.4.0,
# 2.5.1, 2.6.0; right on 2.7.0, 2.7.1, 2.8.0, 2.9.1, 2.13.0). Nothing torch exposes tells them apart
# (auto_functionalized_v2 is in 2.5 and 2.6 too, and 2.6's fails as well), so the version does.
WRITES_INTO_INPUT_VIEWS = TorchVersion(torch.__version__) >= (2, 7)


def define(name: str, schema: str, impl: Callable, fake: Callable) -> Callable | None:
    """Operator `hyrax::<name>` with `schema` (arguments and result, the name left out),
    running `impl` on CPU tensors and `fake` (shapes only) while traced; its default overload,
    or None where this torch cannot define it, or cannot compile its writes into arguments
    (WRITES_INTO_INPUT_VIEWS): traced code then keeps the torch path."""
    global _LIBRARY
    if "!)" in schema and not WRITES_INTO_INPUT_VIEWS:
        log.info("no operator hyrax::%s for traced code (torch %s compiles its writes wrong)", name, torch.__version__)
        return None
    try:
        if _LIBRARY is None:
            _LIBRARY = torch.library.Library("hyrax", "FRAGMENT")
        _LIBRARY.define(f"{name}{schema}")
        _LIBRARY.impl(name, impl, "CPU")
        torch.library.register_fake(f"hyrax::{name}", fake, lib=_LIBRARY)
    except Exception as e:  # noqa: BLE001 - never a failed import over an optional fast path
        log.info("no operator hyrax::%s for traced code (%s: %s)", name, type(e).__name__, e)
        return None
    return getattr(torch.ops.hyrax, name).default
