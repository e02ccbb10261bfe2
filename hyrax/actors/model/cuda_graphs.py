"""CUDA graphs for decode batches. NOT YET RUN ON A GPU: tests/gpu/test_cuda_graph_decode.py
is the check to run where CUDA is.

A graph replays fixed shapes over fixed addresses. A decode batch's key dimension is padded
to a power-of-two bucket (`key_bucket`, through `pad_key_columns`: attention-only, no state
is touched); its batch size is NOT padded: one graph per batch size seen (up to
`max_graph_batch`, beyond it eager), captured on first use. Padding rows would need a slot and
a K/V row that no request owns (the decode conv step shifts every row's window, so a padding
row on a borrowed slot would change it), and the pools have none; once they keep a scratch
unit, batch-size buckets are a padding step away.

A step copies its batch into that graph's static input buffers and replays the graph. The
first batch of a shape is run twice on a side stream over the pools (warm-up, as capture
requires; the batch's recurrent state is kept and put back, `warm_up`), then captured over
them (capture records, it does not run) in a memory pool all graphs share. The step's batch is
then replayed.

Needs the SDPA attention backend: the flash kernel takes host-side lengths per step, which a
graph would freeze at capture (`CudaGraphDecode` refuses other backends at construction).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hyrax.actors.model.batch import AttnIndex, ForwardBatch
from hyrax.actors.model.captured_decode import layer_views, pad_key_columns
from hyrax.actors.model.errors import HyraxInputError

MIN_KEY_BUCKET = 64


def key_bucket(k: int) -> int:
    """The padded key count for K keys: the next power of two above K, at least MIN_KEY_BUCKET."""
    return max(MIN_KEY_BUCKET, 1 << k.bit_length())


def graph_inputs(batch: ForwardBatch) -> tuple[tuple[int, ...], ForwardBatch]:
    """A decode batch's graph key (its batch size and each paged component's key bucket, in
    component-name order) and the batch padded to those buckets, as the graph is fed."""
    keys = {n: key_bucket(i.read_rows.shape[1]) for n, i in batch.attn.items()}
    return (batch.num_seqs, *(keys[n] for n in sorted(keys))), pad_key_columns(batch, keys)


def pool_layout(pools: dict[str, torch.Tensor], names: tuple[str, ...]) -> tuple:
    """Where the pools lie, as a graph's key: each one's address, shape and dtype. A graph
    replays into the pools it was captured over, through per-layer views whose addresses follow
    from all three. The memory-budget profile runs steps on throw-away pools before the engine
    allocates its own, and the allocator may hand the engine's pools the same address with
    another shape: that graph would write each layer's rows at the throw-away layout's offsets."""
    return tuple((pools[n].data_ptr(), tuple(pools[n].shape), pools[n].dtype) for n in names)


def batch_tensors(batch: ForwardBatch) -> list[torch.Tensor]:
    """Every tensor of a batch the forward may read, in a fixed order (static buffers and a
    step's values pair up by position)."""
    out = [getattr(batch, f) for f in _BATCH_TENSORS]
    out += [batch.slots[n] for n in sorted(batch.slots)]
    for n in sorted(batch.attn):
        out += [getattr(batch.attn[n], f) for f in _ATTN_TENSORS]
    return out


def _clone(batch: ForwardBatch) -> ForwardBatch:
    """The batch as a graph holds it: its tensors copied, and each paged component's per-key
    tensors alone. A graph's decode attention (SDPA) reads those; the page table (whose width
    follows the longest context, not the key bucket) and the key layout are left out, so two
    steps of one graph feed it tensors of the same shapes, and a read of what the graph does
    not refresh fails at capture instead of replaying the captured step's pages."""
    attn = {n: AttnIndex(*(getattr(i, f).clone() for f in ("write_rows", "pad_keys")), i.page_table[:, :0],
                         **{f: getattr(i, f).clone() for f in ("read_rows", "key_pos", "key_valid")})
            for n, i in batch.attn.items()}
    return dataclasses.replace(batch, **{f: getattr(batch, f).clone() for f in _BATCH_TENSORS}, attn=attn,
                               slots={n: s.clone() for n, s in batch.slots.items()})


def warm_up(eager, padded: ForwardBatch, pools: dict[str, torch.Tensor], names: tuple[str, ...],
            runs: int = 2) -> None:
    """Run the decode forward `runs` times over the real pools, leaving the state it holds as it
    was: those runs are real decode steps, which advance the batch's recurrent state, so each slot
    component's rows of the batch are kept before and written back after. (Clones of the pools
    cost as much memory again, which pools sized to fill the GPU do not leave.) The paged
    components' writes land on the batch's own new rows (`write_rows`), which the step replayed
    next writes again before anything reads them."""
    kept = {n: pools[n].index_select(1, rows) for n, rows in padded.slots.items() if n in names}
    views = layer_views(pools, names)
    try:
        for _ in range(runs):
            eager(_clone(padded), views)
    finally:
        for n, rows in kept.items():
            pools[n].index_copy_(1, padded.slots[n], rows)


_ATTN_TENSORS = ("write_rows", "read_rows", "pad_keys", "key_pos", "key_valid")
_BATCH_TENSORS = ("input_ids", "positions", "q_valid", "q_lens", "token_index", "context_lens")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static buffers, in `batch_tensors` order
    logits: torch.Tensor  # (B, vocab), written by every replay


class CudaGraphDecode:
    """Decode forward by CUDA graph replay, one graph per (batch size, key buckets, pools),
    captured on first use; batches above `max_graph_batch` run eager."""

    def __init__(self, model, eager, names: tuple[str, ...], device: torch.device, max_graph_batch: int = 128):
        # HyraxInputError: an option this rank cannot honour, one line on the CLI (under `hyrax
        # serve` when the replica starts, as an attention backend its device cannot run)
        if device.type != "cuda":
            raise HyraxInputError(f"--captured-decode cuda_graphs needs a CUDA device; this rank runs on "
                                  f"{device.type} (use compile, or off)")
        others = {b.name for b in model.attention_backends} - {"sdpa"}
        if others:
            raise HyraxInputError(f"--captured-decode cuda_graphs needs --attention-backend sdpa, not "
                                  f"{', '.join(sorted(others))}")
        self.eager, self.names, self.max_graph_batch = eager, names, max_graph_batch
        self.graphs: dict[tuple, _Graph] = {}
        self.mempool = None  # one memory pool shared by every captured graph

    def __call__(self, batch: ForwardBatch, pools: dict[str, torch.Tensor]) -> torch.Tensor:
        """batch: decode-only, B sequences -> logits (B, vocab)."""
        if batch.num_seqs > self.max_graph_batch:
            return self.eager(batch, pools)
        shape, padded = graph_inputs(batch)
        key = (*shape, *pool_layout(pools, self.names))
        g = self.graphs.get(key) or self._capture(key, padded, pools)
        for static, value in zip(g.inputs, batch_tensors(padded)):
            static.copy_(value, non_blocking=True)
        g.graph.replay()
        return g.logits.clone()

    def _capture(self, key: tuple, padded: ForwardBatch, pools: dict[str, torch.Tensor]) -> _Graph:
        """Capture the forward over static copies of `padded`, after the warm-up runs capture
        needs (`warm_up`: over the real pools, their state left as it was); the captured run
        records the real pools' addresses and writes nothing (capture only records)."""
        static = _clone(padded)
        views = layer_views(pools, self.names)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            warm_up(self.eager, padded, pools, self.names)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.mempool):
            logits = self.eager(static, views)
        self.mempool = graph.pool()
        g = self.graphs[key] = _Graph(graph, batch_tensors(static), logits)
        return g
