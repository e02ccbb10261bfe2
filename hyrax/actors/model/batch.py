"""The packed batch one forward step runs over, built from per-request slices.

A step mixes prefill chunks and decode tokens of many requests. Requests are padded to the
longest slice `T` of the step (decode-only steps have T == 1); every per-token tensor is
(B, T) and carries `q_valid` for the padding. Paged components read and write rows of
their pool through row indices computed here, in torch, from each request's page table.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from itertools import chain

import numpy as np
import torch

from hyrax.actors.model.components import WINDOW, ComponentSpec


@dataclass(frozen=True)
class SeqSlice:
    """One request's part of a step: `token_ids` at positions start .. start+len-1."""

    token_ids: list[int]
    start: int
    page_tables: dict[str, list[int]]  # paged component -> page ids (-1: released page)
    slots: dict[str, int]  # slot component -> slot index


# The longest key tile a paged attention kernel reads at once (vllm-flash-attn 2.6's kBlockN
# is at most 256 rows). Its 2.6.2 kernels look up the block table for every row of a
# sequence's last tile, also past the sequence's last page (fixed upstream later), so the
# block table is padded to whole tiles.
KV_TILE_ROWS = 256


@dataclass
class AttnIndex:
    write_rows: torch.Tensor  # (B, T) pool row of each new token, -1 for padding
    read_rows: torch.Tensor  # (B, K) pool row of each visible key, 0 where invalid
    key_pos: torch.Tensor  # (B, K) token position of each key
    key_valid: torch.Tensor  # (B, K) bool
    page_table: torch.Tensor  # (B, P) long, -1 where a page is not held
    block_cols: int = 0  # the block table's width: pages covering the longest context in whole tiles

    @cached_property
    def block_table(self) -> torch.Tensor:
        """The page table as a paged kernel's int32 block table, computed once per step.
        Released pages (-1) and the padding to `block_cols` become page 0: they lie before
        the window or past the context, so they are never read unmasked, and the address
        stays inside the pool."""
        pad = max(0, self.block_cols - self.page_table.shape[1])
        return torch.nn.functional.pad(self.page_table.clamp(min=0), (0, pad)).to(torch.int32)


@dataclass
class ForwardBatch:
    input_ids: torch.Tensor  # (B, T) long, 0 at padding
    positions: torch.Tensor  # (B, T) long
    q_valid: torch.Tensor  # (B, T) bool
    q_lens: torch.Tensor  # (B,) long
    attn: dict[str, AttnIndex]
    slots: dict[str, torch.Tensor]  # slot component -> (B,) long
    page_size: int
    context_lens: torch.Tensor  # (B,) long: tokens in context after this step (from position 0)
    max_context: int  # the longest of them, known on the host (no device sync to read it)

    @cached_property
    def cu_seqlens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """int32 prefix sums of query lengths and of context lengths, (B + 1,) each: the
        varlen kernels' request boundaries, computed once per step for every layer."""
        zero = torch.zeros(1, dtype=torch.int32, device=self.q_lens.device)
        return (torch.cat([zero, self.q_lens.cumsum(0, dtype=torch.int32)]),
                torch.cat([zero, self.context_lens.cumsum(0, dtype=torch.int32)]))

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]

    @property
    def max_len(self) -> int:
        return self.input_ids.shape[1]


def _ragged(rows: list[list[int]], width: int, fill: int) -> torch.Tensor:
    """(len(rows), width) long tensor of the rows left-aligned, `fill` after each: one copy
    of all the values, not one small tensor per row."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), width), fill, dtype=np.int64)
    out[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(chain.from_iterable(rows), dtype=np.int64,
                                                                  count=int(lens.sum()))
    return torch.from_numpy(out)


def build_forward_batch(
    seqs: list[SeqSlice], components: tuple[ComponentSpec, ...], page_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    if not seqs:
        raise ValueError("empty batch")
    B = len(seqs)
    q_lens = torch.tensor([len(s.token_ids) for s in seqs], dtype=torch.long)
    starts = torch.tensor([s.start for s in seqs], dtype=torch.long)
    T = int(q_lens.max())
    ar_t = torch.arange(T)
    q_valid = ar_t[None, :] < q_lens[:, None]
    positions = torch.where(q_valid, starts[:, None] + ar_t[None, :], torch.zeros((), dtype=torch.long))
    ids = _ragged([s.token_ids for s in seqs], T, 0)
    ctx = starts + q_lens  # tokens in context after this step
    max_tiles = -(-int(ctx.max()) // KV_TILE_ROWS)
    attn: dict[str, AttnIndex] = {}
    slots: dict[str, torch.Tensor] = {}
    for comp in components:
        if not comp.paged:
            slots[comp.name] = torch.tensor([s.slots[comp.name] for s in seqs], dtype=torch.long, device=device)
            continue
        tables = [s.page_tables[comp.name] for s in seqs]
        n_pages = max(1, max(map(len, tables)))
        pt = _ragged(tables, n_pages, -1)

        def rows_at(pos: torch.Tensor, valid: torch.Tensor, pt=pt) -> torch.Tensor:
            page = pt.gather(1, (pos // page_size).clamp(0, n_pages - 1))
            rows = page * page_size + pos % page_size
            if bool(((page < 0) & valid).any()):
                raise RuntimeError(f"{comp.name}: a step touches a position whose page is not allocated")
            return torch.where(valid, rows, torch.full_like(rows, -1))

        if comp.kind == WINDOW:
            read_start = (starts - comp.window + 1).clamp(min=0)
        else:
            read_start = torch.zeros_like(starts)
        n_keys = ctx - read_start
        K = int(n_keys.max())
        key_pos = read_start[:, None] + torch.arange(K)[None, :]
        key_valid = torch.arange(K)[None, :] < n_keys[:, None]
        read_rows = rows_at(key_pos, key_valid).clamp(min=0)
        attn[comp.name] = AttnIndex(
            write_rows=rows_at(positions, q_valid).to(device),
            read_rows=read_rows.to(device),
            key_pos=key_pos.to(device),
            key_valid=key_valid.to(device),
            page_table=pt.to(device),
            block_cols=-(-max_tiles * KV_TILE_ROWS // page_size),
        )
    return ForwardBatch(
        input_ids=ids.to(device), positions=positions.to(device), q_valid=q_valid.to(device),
        q_lens=q_lens.to(device), attn=attn, slots=slots,
        page_size=page_size, context_lens=ctx.to(device), max_context=int(ctx.max()),
    )
