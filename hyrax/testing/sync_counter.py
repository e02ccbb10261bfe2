"""A counting stand-in for the device: what one engine step would make the host wait for on a
GPU, measured on the CPU.

On CUDA the host runs ahead of the device until it needs a value the device computes, or
hands the device data from pageable host memory. The ops that do that are few and known;
on the CPU they cost nothing, so nothing times or fails there. `SyncCounter` is a
`TorchFunctionMode` that keeps its own model of where each tensor would live and records
every such op in the calls it wraps (`wrap(fn)`), e.g. `RankRuntime.execute`.

Where a tensor lives (the model): *device* tensors are the roots given (a model's
parameters and buffers, the pools), anything created with a `device=` argument, anything
moved by `.to(<device>)` / `.cuda()` / `as_tensor(..., device=)`, and every result of an op
with a device operand. Every other tensor is *host*: made from Python or numpy data
without a device (`torch.tensor(list)`, `from_numpy`), by a factory without a device
(`arange(n)`), and what host ops compute from those. On the CPU the engine's device is
"cpu" too, so a `device=` argument always means the device (code that means the host
passes none). `.cpu()` means the host. A tensor made before the wrapped call and not among
the roots (a device-side cache filled in an earlier call) counts as host: give such caches
as roots, or read their UPLOADs as the cache's first fill.

What is counted (each an `Event` with its kind, the op and the first hyrax source line):

- READ (a sync): a device value read on the host: `item`, `tolist`, `bool`/`int`/`float`/
  `index` of a tensor, `cpu`, `numpy`, `repr`, and a host tensor written from a device one.
- SHAPE (a sync): an op on a device tensor whose output size depends on its values:
  `nonzero`, `argwhere`, `masked_select`, `unique`, `unique_consecutive`, `bincount`,
  one-argument `where`, `repeat_interleave` with tensor repeats and no `output_size`, and
  indexing (`[]`, `[]=`, `index_put`) with a boolean mask.
- UPLOAD (a sync: the copy from pageable memory waits for the stream): host data handed to
  the device without `non_blocking=True`: `.to(device)`, `copy_`, `tensor(data, device=)`
  and `as_tensor(data, device=)`, a Python list used as an index of a device tensor, and a
  host tensor of one or more dimensions used as an operand of an op on device tensors
  (CUDA copies such an index over; 0-d host tensors pass as scalars and are not counted).
- ASYNC_UPLOAD (not a sync): `.to(device, non_blocking=True)` / `copy_(..., non_blocking=True)`
  of a host tensor. On CUDA it overlaps only from pinned memory: the code pins where the
  device is CUDA, which the CPU cannot check (pinning needs CUDA).

A kernel that stands in for a device kernel (the CPU reference of FlashAttention) runs
through `opaque(fn)`: its own ops are not counted, its outputs are device tensors, and each
host tensor argument counts as an UPLOAD (the real kernel takes device tensors only).
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves


class Kind(Enum):
    READ = "device->host read"
    SHAPE = "data-dependent shape"
    UPLOAD = "blocking host->device copy"
    ASYNC_UPLOAD = "non-blocking host->device copy"


SYNC_KINDS = (Kind.READ, Kind.SHAPE, Kind.UPLOAD)


@dataclass(frozen=True)
class Event:
    kind: Kind
    op: str
    where: str  # file:line of the innermost hyrax frame that called the op


@dataclass
class Counts:
    """The events of one wrapped call."""

    events: list[Event] = field(default_factory=list)

    @property
    def syncs(self) -> int:
        """Host synchronisations: READ + SHAPE + UPLOAD events."""
        return sum(e.kind in SYNC_KINDS for e in self.events)

    def of(self, kind: Kind) -> int:
        return sum(e.kind is kind for e in self.events)

    def table(self) -> str:
        """One line per distinct (kind, op, where) with its count, most frequent first."""
        rows = Counter((e.kind.name, e.op, e.where) for e in self.events)
        return "\n".join(f"{n:4d}  {k:<12} {op:<20} {w}" for (k, op, w), n in rows.most_common())


_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "__complex__", "cpu", "numpy",
          "__repr__", "__format__"}
_SHAPES = {"nonzero", "argwhere", "masked_select", "unique", "unique_consecutive", "bincount"}
_INDEXING = {"__getitem__", "__setitem__", "index_put", "index_put_"}
_FROM_DATA = {"tensor", "as_tensor", "asarray"}
_HERE = os.path.abspath(__file__)
_PACKAGE = os.path.dirname(os.path.dirname(_HERE))


_SCALARS = (int, float, bool, str, type(None), slice, type(Ellipsis), torch.dtype, torch.device, torch.layout,
            torch.memory_format)


def _tensors(tree) -> list[torch.Tensor]:
    """The tensors among the pytree leaves of `tree`, in order (what `tree_leaves` finds).

    Called on every torch call's arguments: plain tuples, lists and dicts are walked here and
    scalars skipped, which is several times faster than `tree_leaves`; any other container
    goes to `tree_leaves`, so the result is the same."""
    out: list[torch.Tensor] = []
    _collect(tree, out)
    return out


def _collect(x, out: list[torch.Tensor]) -> None:
    kind = type(x)
    if isinstance(x, torch.Tensor):
        out.append(x)
    elif kind is tuple or kind is list:
        for y in x:
            _collect(y, out)
    elif kind is dict:
        for y in x.values():
            _collect(y, out)
    elif not isinstance(x, _SCALARS):
        out.extend(t for t in tree_leaves(x) if isinstance(t, torch.Tensor))


def _caller() -> str:
    """file:line of the innermost frame inside the hyrax package but outside this module."""
    frame = sys._getframe(1)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path.startswith(_PACKAGE) and path != _HERE:
            return f"{os.path.relpath(path, os.path.dirname(_PACKAGE))}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


class SyncCounter(TorchFunctionMode):
    """Counts, per wrapped call, the ops that make the host wait on a GPU (module docstring).

    roots: the tensors that live on the device before the call (parameters, buffers, pools).
    """

    def __init__(self, roots: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._roots = list(roots)
        self._device: dict[int, torch.Tensor] = {}
        self._opaque = False
        self.calls: list[Counts] = []

    # ---- use ------------------------------------------------------------------------------
    def wrap(self, fn: Callable) -> Callable:
        """fn, counting each call into a new `Counts` appended to `self.calls`."""
        def counted(*args, **kwargs):
            self.calls.append(Counts())
            self._device = {id(t): t for t in self._roots}
            try:
                with self:
                    return fn(*args, **kwargs)
            finally:
                self._device = {}
        return counted

    def opaque(self, kernel: Callable) -> Callable:
        """A stand-in for a device kernel: not looked into, takes and returns device tensors."""
        def run(*args, **kwargs):
            if not self._counting():
                return kernel(*args, **kwargs)
            for t in _tensors((args, kwargs)):
                if not self._on_device(t):
                    self._record(Kind.UPLOAD, getattr(kernel, "__name__", "kernel"))
            with self._looking_away():
                out = kernel(*args, **kwargs)
            self._mark(out)
            return out
        return run

    # ---- the model of where tensors live ------------------------------------------------------
    def _counting(self) -> bool:
        return bool(self.calls) and bool(self._device)

    def _on_device(self, t: torch.Tensor) -> bool:
        return self._device.get(id(t)) is t

    def _mark(self, out) -> None:
        for t in _tensors(out):
            self._device[id(t)] = t

    def _record(self, kind: Kind, op: str) -> None:
        self.calls[-1].events.append(Event(kind, op, _caller()))

    @contextmanager
    def _looking_away(self):
        self._opaque = True
        try:
            yield
        finally:
            self._opaque = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._opaque or not self._device:
            return func(*args, **kwargs)
        name = getattr(func, "__name__", str(func))
        if name in ("to", "cuda", "cpu", "copy_"):
            return self._transfer(func, name, args, kwargs)
        inputs = _tensors((args, kwargs))
        dev = [t for t in inputs if self._on_device(t)]
        host = [t for t in inputs if not self._on_device(t) and t.dim() > 0]
        if dev:
            self._count_device_op(name, args, kwargs, host)
        elif name in _FROM_DATA and kwargs.get("device") is not None:
            self._record(Kind.UPLOAD, name)  # Python data or a host tensor, copied from pageable memory
        out = func(*args, **kwargs)
        if self._writes_first_arg(name, args) and inputs and inputs[0] is args[0]:
            if not self._on_device(args[0]) and dev:
                self._record(Kind.READ, name)  # a host tensor written from the device
            return out
        if dev or kwargs.get("device") is not None:
            self._mark(out)
        return out

    @staticmethod
    def _writes_first_arg(name: str, args) -> bool:
        in_place = name.endswith("_") and not name.startswith("__")
        return bool(args) and isinstance(args[0], torch.Tensor) and (in_place or name == "__setitem__")

    def _count_device_op(self, name: str, args, kwargs, host: list[torch.Tensor]) -> None:
        if name in _READS:
            self._record(Kind.READ, name)
        elif name in _SHAPES or (name == "where" and len(args) + len(kwargs) == 1):
            self._record(Kind.SHAPE, name)
        elif name == "repeat_interleave" and kwargs.get("output_size") is None:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if repeats is None or isinstance(repeats, torch.Tensor):
                self._record(Kind.SHAPE, name)
        elif name in _INDEXING and len(args) > 1:
            index = args[1]
            for part in index if isinstance(index, tuple) or name.startswith("index_put") else (index,):
                if isinstance(part, torch.Tensor) and part.dtype in (torch.bool, torch.uint8):
                    self._record(Kind.SHAPE, f"{name}[mask]")
                elif isinstance(part, list):
                    self._record(Kind.UPLOAD, f"{name}[list]")
        for _ in host:
            self._record(Kind.UPLOAD, f"{name}(host operand)")

    def _transfer(self, func, name: str, args, kwargs):
        src = args[0]
        non_blocking = bool(kwargs.get("non_blocking", False))
        if name == "copy_":
            other = args[1] if len(args) > 1 else kwargs["src"]
            non_blocking = non_blocking or (len(args) > 2 and bool(args[2]))
            to_device, from_device = self._on_device(src), self._on_device(other)
            if to_device and not from_device and other.dim() > 0:
                self._record(Kind.ASYNC_UPLOAD if non_blocking else Kind.UPLOAD, name)
            elif from_device and not to_device:
                self._record(Kind.READ, name)
            return func(*args, **kwargs)
        if name == "cpu":
            to_device = False
        elif name == "cuda":
            to_device = True
        else:
            target = next((a for a in args[1:] if isinstance(a, torch.Tensor)), kwargs.get("other"))
            if isinstance(target, torch.Tensor):
                to_device = self._on_device(target)
            else:
                device, _, nb, _ = torch._C._nn._parse_to(*args[1:], **kwargs)
                non_blocking = non_blocking or nb
                to_device = self._on_device(src) if device is None else True
        out = func(*args, **kwargs)
        if to_device and not self._on_device(src):
            self._record(Kind.ASYNC_UPLOAD if non_blocking else Kind.UPLOAD, name)
            out = out.clone() if out is src else out  # on the CPU `.to` may return its input
            self._mark(out)
        elif to_device:
            self._mark(out)
        elif self._on_device(src):
            self._record(Kind.READ, name)
        return out


def rank_counter(rank) -> SyncCounter:
    """A counter whose device holds `rank`'s model (parameters and buffers) and pools; its
    `execute` is to be wrapped: `rank.execute = counter.wrap(rank.execute)`."""
    return SyncCounter([*rank.model.parameters(), *rank.model.buffers(), *rank.pools.values()])
