"""CUDA graphs for decode batches. NOT YET RUN ON A GPU: tests/gpu/test_cuda_graph_decode.py
is the check to run where CUDA is.

A graph replays fixed shapes over fixed addresses, so a decode batch is padded to a bucket in
both dimensions (`graph_inputs`):
- its batch size to `batch_bucket` (1, 2, 4, 8, then multiples of 8, up to `max_graph_batch`;
  beyond it eager). The padding rows are sequences of one token at position 0 on the pools'
  scratch unit: every pool built for graphs keeps `SCRATCH_UNITS` past its capacity that no
  allocator hands out (engine/pools.py), so a padding row reads and writes state nobody owns
  (the decode conv step shifts its row's window; on a borrowed slot it would change a request's).
  Their logits are dropped.
- its key dimension to a power-of-two `key_bucket` (`pad_key_columns`: attention-only, no state
  is touched).
One graph per (batch bucket, key buckets, pool layout), captured on first use.

A step copies its batch into that graph's static input buffers and replays the graph. The
first batch of a shape is run twice on a side stream over the pools (warm-up, as capture
requires; the batch's recurrent state is kept and put back, `warm_up`), then captured over
them (capture records, it does not run) in a memory pool all graphs share. The step's batch is
then replayed.

Needs the SDPA attention backend: the flash kernel takes host-side lengths per step, which a
graph would freeze at capture (`CudaGraphDecode` refuses other backends at construction).

Models with routed experts: the MoE layer's own dispatch (moe.py) reads which experts a step
chose on the host, which capture forbids, so the forward that is warmed up and captured runs
them in their static dispatch (`moe.CaptureSafe`: every expert over every row of the padded
batch, weighted by its routing weight, 0 where not chosen). Prefill and batches beyond
`max_graph_batch` run the model's own forward, with the sparse dispatch.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from hyrax.actors.model.batch import AttnIndex, ForwardBatch
from hyrax.actors.model.captured_decode import layer_views, pad_key_columns
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.moe import CaptureSafe

MIN_KEY_BUCKET = 64
SCRATCH_UNITS = 1  # units (a page, a slot) a pool built for graphs keeps past its capacity


def key_bucket(k: int) -> int:
    """The padded key count for K keys: the next power of two above K, at least MIN_KEY_BUCKET."""
    return max(MIN_KEY_BUCKET, 1 << k.bit_length())


def batch_bucket(b: int) -> int:
    """The batch size the graph replaying B sequences was captured at: 1, 2, 4, 8, then the next
    multiple of 8 (at most 7 padding rows, and 19 buckets up to 128)."""
    return 1 << (b - 1).bit_length() if b <= 8 else -(-b // 8) * 8


def scratch_rows(pools: dict[str, torch.Tensor], names: tuple[str, ...], page_size: int,
                 paged: frozenset[str]) -> dict[str, int]:
    """The pool row padding rows use in each component: the first row of its scratch unit, the
    pool's last (a page of rows for a paged component, one row for a slot component)."""
    return {n: pools[n].shape[1] - (page_size if n in paged else 1) for n in names}


def pad_batch_rows(batch: ForwardBatch, rows: int, scratch: dict[str, int]) -> ForwardBatch:
    """The decode batch with `rows` - B padding sequences after its own: one token (id 0) at
    position 0 each, its slot and its one key on the component's `scratch` row (the key valid,
    so its attention is over one key, not none). The first B rows are the batch's, unchanged."""
    B = batch.num_seqs
    n = rows - B
    if n < 0:
        raise ValueError(f"cannot pad a batch of {B} sequences to {rows}")
    if n == 0:
        return batch
    dev = batch.input_ids.device

    def more(t: torch.Tensor, fill) -> torch.Tensor:
        return torch.cat([t, t.new_full((n, *t.shape[1:]), fill)])

    attn = {}
    for name, i in batch.attn.items():
        row = scratch[name]
        first = torch.zeros(n, i.read_rows.shape[1], dtype=torch.bool, device=dev)
        first[:, 0] = True
        attn[name] = AttnIndex(more(i.write_rows, row), i.pad_keys, more(i.page_table, -1), i.block_cols,
                               read_rows=torch.cat([i.read_rows, torch.where(first, row, 0)]),
                               key_pos=more(i.key_pos, 0), key_valid=torch.cat([i.key_valid, first]))
    return dataclasses.replace(
        batch, input_ids=more(batch.input_ids, 0), positions=more(batch.positions, 0),
        q_valid=more(batch.q_valid, True), q_lens=more(batch.q_lens, 1),
        token_index=torch.arange(rows, dtype=batch.token_index.dtype, device=dev),
        context_lens=more(batch.context_lens, 1), attn=attn,
        slots={name: more(s, scratch[name]) for name, s in batch.slots.items()})


def graph_inputs(batch: ForwardBatch, scratch: dict[str, int]) -> tuple[tuple[int, ...], ForwardBatch]:
    """A decode batch's graph key (its batch bucket and each paged component's key bucket, in
    component-name order) and the batch padded to those buckets, as the graph is fed: rows on
    the `scratch` rows (`scratch_rows`), then key columns."""
    rows = batch_bucket(batch.num_seqs)
    keys = {n: key_bucket(i.read_rows.shape[1]) for n, i in batch.attn.items()}
    padded = pad_key_columns(pad_batch_rows(batch, rows, scratch), keys)
    return (rows, *(keys[n] for n in sorted(keys))), padded


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
            runs: int = 2) -> torch.Tensor:
    """Run the decode forward `runs` times over the real pools, leaving the state it holds as it
    was (the last run's logits returned: their shape and dtype size the graphs' output): those runs are real decode steps, which advance the batch's recurrent state, so each slot
    component's rows of the batch are kept before and written back after. (Clones of the pools
    cost as much memory again, which pools sized to fill the GPU do not leave.) The paged
    components' writes land on the batch's own new rows (`write_rows`), which the step replayed
    next writes again before anything reads them."""
    kept = {n: pools[n].index_select(1, rows) for n, rows in padded.slots.items() if n in names}
    views = layer_views(pools, names)
    try:
        for _ in range(runs):
            logits = eager(_clone(padded), views)
        return logits
    finally:
        for n, rows in kept.items():
            pools[n].index_copy_(1, padded.slots[n], rows)


_ATTN_TENSORS = ("write_rows", "read_rows", "pad_keys", "key_pos", "key_valid")
_BATCH_TENSORS = ("input_ids", "positions", "q_valid", "q_lens", "token_index", "context_lens")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]  # static buffers, in `batch_tensors` order


class CudaGraphDecode:
    """Decode forward by CUDA graph replay, one graph per (batch bucket, key buckets, pools),
    captured on first use; batches whose bucket is above `max_graph_batch` run eager. The pools must keep their
    scratch units (engine/pools.py, `scratch_units`): padding rows write there."""

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
        # what is warmed up and captured: `eager` with the MoE layers (if any) in static dispatch
        self.captured = CaptureSafe(model, eager)
        self.paged = frozenset(c.name for c in model.components if c.paged)
        self.graphs: dict[tuple, _Graph] = {}
        self.mempool = None  # one memory pool shared by every captured graph
        # (max_graph_batch, vocab): the graph of bucket B writes its logits into the first B rows.
        # One buffer for all: an output made inside each capture stayed allocated with its graph
        # (bucket x vocab x 4 bytes each: ~0.5 GB per key bucket over the 19 buckets at a 128k
        # vocabulary, outside the memory budget); a capture's own temporaries go back to the
        # shared pool, where the next capture reuses them (graphs replay one at a time)
        self.out: torch.Tensor | None = None

    def __call__(self, batch: ForwardBatch, pools: dict[str, torch.Tensor]) -> torch.Tensor:
        """batch: decode-only, B sequences -> logits (B, vocab)."""
        if batch_bucket(batch.num_seqs) > self.max_graph_batch:
            return self.eager(batch, pools)
        shape, padded = graph_inputs(batch, scratch_rows(pools, self.names, batch.page_size, self.paged))
        key = (*shape, *pool_layout(pools, self.names))
        g = self.graphs.get(key) or self._capture(key, padded, pools)
        for static, value in zip(g.inputs, batch_tensors(padded)):
            static.copy_(value, non_blocking=True)
        g.graph.replay()
        return self.out[:batch.num_seqs].clone()

    def _capture(self, key: tuple, padded: ForwardBatch, pools: dict[str, torch.Tensor]) -> _Graph:
        """Capture the forward over static copies of `padded`, after the warm-up runs capture
        needs (`warm_up`: over the real pools, their state left as it was); the captured run
        records the real pools' addresses and writes nothing (capture only records)."""
        static = _clone(padded)
        views = layer_views(pools, self.names)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            logits = warm_up(self.captured, padded, pools, self.names)
        torch.cuda.current_stream().wait_stream(side)
        if self.out is None:
            self.out = logits.new_empty(self.max_graph_batch, logits.shape[-1])
        del logits
        graph = torch.cuda.CUDAGraph()
        # thread_local: only this thread's calls are checked during the capture; in the default
        # (global) mode another thread's unsafe call (the NCCL watchdog of a TP >= 2 rank polls
        # its collectives' events) would invalidate the capture
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            self.out[:padded.num_seqs].copy_(self.captured(static, views))
        self.mempool = graph.pool()
        g = self.graphs[key] = _Graph(graph, batch_tensors(static))
        return g
