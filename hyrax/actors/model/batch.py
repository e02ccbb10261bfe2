"""The packed batch one forward step runs over, built from per-request slices.

A step mixes prefill chunks and decode tokens of many requests. Requests are padded to the
longest slice `T` of the step (decode-only steps have T == 1); every per-token tensor is
(B, T) and carries `q_valid` for the padding. Paged components read and write rows of
their pool through row indices computed here, in torch, from each request's page table.

Everything is computed on the host (where the request data is; reading a size or checking a
page costs nothing there) and goes to the device in one copy (`to_device`): on a GPU the
step's forward then never waits for the host, nor the host for it, until the tokens are read.
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
    write_rows: torch.Tensor  # (N,) pool row of each of the step's N tokens, in `ForwardBatch.token_index` order
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
    token_index: torch.Tensor  # (N,) long: position in the flattened (B * T) of each real token, in order
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


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, by a copy the host does not wait for: `non_blocking` from
    pinned memory on CUDA (a copy from pageable memory waits for the stream first)."""
    device = torch.device(device)
    if device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def to_device(host: dict[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The same tensors (long or bool, any shapes) on `device`, moved in ONE copy: packed into
    one int64 host buffer (pinned on CUDA), `upload`ed, and split there into views (bool
    fields converted on the device)."""
    device = torch.device(device)
    flat = [t.reshape(-1) for t in host.values()]
    buf = torch.empty(sum(t.numel() for t in flat), dtype=torch.long, pin_memory=device.type == "cuda")
    torch.cat(flat, out=buf)
    moved = upload(buf, device)
    out, at = {}, 0
    for (name, t), f in zip(host.items(), flat):
        view = moved[at:at + f.numel()].view(t.shape)
        out[name] = view.bool() if t.dtype == torch.bool else view
        at += f.numel()
    return out


def build_forward_batch(
    seqs: list[SeqSlice], components: tuple[ComponentSpec, ...], page_size: int, device: torch.device | str = "cpu"
) -> ForwardBatch:
    """The step's batch on `device`, computed on the host and moved in one copy (`to_device`)."""
    if not seqs:
        raise ValueError("empty batch")
    lens = [len(s.token_ids) for s in seqs]
    contexts = [s.start + n for s, n in zip(seqs, lens)]  # tokens in context after this step
    q_lens = torch.tensor(lens, dtype=torch.long)
    starts = torch.tensor([s.start for s in seqs], dtype=torch.long)
    T, max_context = max(lens), max(contexts)
    ar_t = torch.arange(T)
    q_valid = ar_t[None, :] < q_lens[:, None]
    positions = torch.where(q_valid, starts[:, None] + ar_t[None, :], torch.zeros((), dtype=torch.long))
    token_index = q_valid.reshape(-1).nonzero().reshape(-1)  # on the host: no device sync
    ctx = torch.tensor(contexts, dtype=torch.long)
    host = {"input_ids": _ragged([s.token_ids for s in seqs], T, 0), "positions": positions, "q_valid": q_valid,
            "q_lens": q_lens, "token_index": token_index, "context_lens": ctx}
    max_tiles = -(-max_context // KV_TILE_ROWS)
    slot_names, paged = [], []
    for comp in components:
        if not comp.paged:
            host[comp.name] = torch.tensor([s.slots[comp.name] for s in seqs], dtype=torch.long)
            slot_names.append(comp.name)
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
        paged.append(comp.name)
        host.update({
            f"{comp.name}.write_rows": rows_at(positions, q_valid).reshape(-1)[token_index],
            f"{comp.name}.read_rows": rows_at(key_pos, key_valid).clamp(min=0),
            f"{comp.name}.key_pos": key_pos, f"{comp.name}.key_valid": key_valid, f"{comp.name}.page_table": pt,
        })
    dev = to_device(host, device)
    attn = {name: AttnIndex(
        write_rows=dev[f"{name}.write_rows"], read_rows=dev[f"{name}.read_rows"], key_pos=dev[f"{name}.key_pos"],
        key_valid=dev[f"{name}.key_valid"], page_table=dev[f"{name}.page_table"],
        block_cols=-(-max_tiles * KV_TILE_ROWS // page_size),
    ) for name in paged}
    return ForwardBatch(
        input_ids=dev["input_ids"], positions=dev["positions"], q_valid=dev["q_valid"], q_lens=dev["q_lens"],
        token_index=dev["token_index"], attn=attn, slots={name: dev[name] for name in slot_names},
        page_size=page_size, context_lens=dev["context_lens"], max_context=max_context,
    )
