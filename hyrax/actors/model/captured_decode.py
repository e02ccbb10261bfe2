"""Captured decode steps: decode-only batches (one token per sequence) run through a captured
forward; prefill, mixed steps and `all_logits` calls stay eager. Chosen once, at model load
(`capture_decode`): the model's `forward` becomes a `CapturedDecode` when the engine asks for it.

- CPU (`CompiledDecode`): `torch.compile` of `HybridModel.forward`, one graph whose batch and
  key dimensions are dynamic, so one compile serves every decode batch size >= 2 and context
  length (batch size 1 gets a second graph). Numbers in docs/captured-steps.md.
- CUDA (`cuda_graphs.CudaGraphDecode`): CUDA graphs; see that module.

Both see each step's batch with its key dimension padded (`pad_key_columns`): at least one
invalid key column, and `pad_keys` (the flat indices of the invalid keys, whose count depends
on the contexts) turned into a fixed-size list, so its length never specialises a graph.

Pools go in as one view per layer (`pools[name].unbind(0)`): the model indexes them by local
layer either way, and as separate, non-overlapping inputs the compiled graph writes each
layer's rows in place. Handed the whole (layers, rows, ...) tensors, torch.compile's
functionalisation rewrote every pool of every layer on every step (measured: the step's time
grew with the pool capacity, 4x slower than eager at 65k K/V rows).
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from hyrax.actors.model.batch import AttnIndex, ForwardBatch

CAPTURE_MODES = ("off", "compile", "cuda_graphs")

Forward = Callable[..., torch.Tensor]  # HybridModel.forward(batch, pools, all_logits=False) -> logits
DecodeForward = Callable[[ForwardBatch, dict], torch.Tensor]


def layer_views(pools: dict[str, torch.Tensor], names: tuple[str, ...]) -> dict[str, tuple[torch.Tensor, ...]]:
    """{name: (layers, rows, ...)} -> {name: one (rows, ...) view per layer}, for the model's own
    components only (checkpoint pools are never read by a forward). The views share the pools'
    memory: a write through them is a write into the pool."""
    return {n: pools[n].unbind(0) for n in names}


def _pad_cols(t: torch.Tensor, cols: int, fill) -> torch.Tensor:
    """t: (B, K) -> (B, cols), `fill` after column K."""
    out = t.new_full((t.shape[0], cols), fill)
    out[:, :t.shape[1]] = t
    return out


def pad_key_columns(batch: ForwardBatch, keys: dict[str, int]) -> ForwardBatch:
    """The batch with each paged component's key dimension K padded to `keys[name]` (> K)
    invalid keys (row 0, position 0, not valid) and its `pad_keys` (M,) replaced by a (B * K',)
    list of invalid keys: every invalid key's own index, and for each valid key the index of
    the first padding key (row 0, column K), so zeroing them zeroes exactly the invalid ones.
    Only attention reads these: the state the step writes is the same."""
    attn = {}
    for name, idx in batch.attn.items():
        B, K = idx.read_rows.shape
        cols = keys[name]
        if cols <= K:
            raise ValueError(f"{name}: key padding to {cols} columns does not pass K = {K}")
        valid = _pad_cols(idx.key_valid, cols, False)
        flat = torch.arange(B * cols, device=valid.device)
        attn[name] = idx.with_keys(read_rows=_pad_cols(idx.read_rows, cols, 0), key_pos=_pad_cols(idx.key_pos, cols, 0),
                                   key_valid=valid, pad_keys=torch.where(valid.view(-1), K, flat))
    return dataclasses.replace(batch, attn=attn)


def mark_dynamic(batch: ForwardBatch) -> None:
    """Mark every dimension of every tensor of the batch as dynamic (torch.compile), so one
    graph serves all batch sizes and key counts. Dimensions of size 0 or 1 (the decode step's
    T, a batch of one) stay specialised: torch.compile compiles those once more, separately."""
    from torch._dynamo import maybe_mark_dynamic  # imported on first use, not with the config

    def tensors(obj):
        for f in dataclasses.fields(obj):
            v = getattr(obj, f.name)
            values = v.values() if isinstance(v, dict) else (v,)
            for x in values:
                if isinstance(x, torch.Tensor):
                    yield x
                elif isinstance(x, AttnIndex):
                    yield from x.tensors()

    for t in tensors(batch):
        for d in range(t.dim()):
            maybe_mark_dynamic(t, d)


def _guard_options() -> dict:
    """torch.compile options: no per-call guards on the model's modules where this torch can drop
    them (`guard_filter_fn`, torch >= 2.8). A loaded model's modules never change (weights,
    layer indices, mixer kinds are fixed at load), and their guards were most of the ~0.36 ms
    dynamo spent checking before each compiled decode step (demo, B = 16). The batch's and the
    pools' tensors keep theirs."""
    skip = getattr(torch.compiler, "skip_guard_on_all_nn_modules_unsafe", None)
    return {"guard_filter_fn": skip} if skip is not None else {}  # older torch: no options at all


class CompiledDecode:
    """The decode forward through torch.compile (CPU). `eager`: the model's own forward;
    `names`: the model's state components; `backend`: torch.compile's (the unit tests also run
    "aot_eager", which traces and functionalises the same graph without inductor's minutes of
    kernel builds)."""

    def __init__(self, eager: Forward, names: tuple[str, ...], backend: str = "inductor"):
        self.names = names
        self.compiled = torch.compile(eager, dynamic=None, backend=backend, options=_guard_options() or None)

    def __call__(self, batch: ForwardBatch, pools: dict[str, torch.Tensor]) -> torch.Tensor:
        """batch: decode-only (T == 1), B sequences -> logits (B, vocab)."""
        padded = pad_key_columns(batch, {n: i.read_rows.shape[1] + 1 for n, i in batch.attn.items()})
        mark_dynamic(padded)
        try:
            return self.compiled(padded, layer_views(pools, self.names))
        finally:
            # inductor's CPU kernels of torch < 2.6 are linked with -ffast-math, and with gcc < 13
            # loading one (a step that compiled) turns on flush-to-zero and denormals-are-zero
            # for the calling thread: every later op of the thread (eager steps, the C kernels)
            # would compute denormal numbers as 0, and its other threads would not. Off again
            # (~0.2 us; no-op where the flags were never set).
            torch.set_flush_denormal(False)


class CapturedDecode:
    """A model forward that sends decode-only batches to `decode` (a `CompiledDecode` or a
    `CudaGraphDecode`) and everything else to `eager`."""

    def __init__(self, eager: Forward, decode: DecodeForward):
        self.eager, self.decode = eager, decode

    def __call__(self, batch: ForwardBatch, pools: dict[str, torch.Tensor], all_logits: bool = False) -> torch.Tensor:
        """Logits (B, vocab), or (B, T, vocab) with `all_logits` (always eager)."""
        if batch.max_len == 1 and not all_logits:
            return self.decode(batch, pools)
        return self.eager(batch, pools, all_logits)


def capture_decode(model: torch.nn.Module, mode: str, device: torch.device | str) -> None:
    """Route `model`'s decode steps through a captured forward (`mode` from CAPTURE_MODES;
    "off" leaves the model alone). "compile" runs on any device; "cuda_graphs" needs CUDA."""
    if mode not in CAPTURE_MODES:
        raise ValueError(f"captured decode mode must be one of {', '.join(CAPTURE_MODES)}, got {mode!r}")
    if mode == "off":
        return
    if isinstance(model.forward, CapturedDecode):
        raise ValueError("the model's decode steps are captured already")
    eager = model.forward
    names = tuple(c.name for c in model.components)
    if mode == "compile":
        decode = CompiledDecode(eager, names)
    else:
        from hyrax.actors.model.cuda_graphs import CudaGraphDecode
        decode = CudaGraphDecode(model, eager, names, torch.device(device))
    model.forward = CapturedDecode(eager, decode)
