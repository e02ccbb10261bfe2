"""The packed batch one forward step runs over, built from per-request slices.

A step mixes prefill chunks and decode tokens of many requests. Requests are padded to the
longest slice `T` of the step (decode-only steps have T == 1); every per-token tensor is
(B, T) and carries `q_valid` for the padding. Paged components read and write rows of
their pool through row indices computed here, in torch, from each request's page table.

Everything is computed on the host (where the request data is; reading a size or checking a
page costs nothing there) and goes to the device in one copy (`to_device`): on a GPU the
step's forward then never waits for the host, nor the host for it, until the tokens are read.
On a CPU device the arrays become tensors as they are, without a copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from itertools import chain
from operator import attrgetter, itemgetter
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch

from hyrax.actors.model.components import WINDOW, ComponentSpec


class SeqSlice(NamedTuple):
    """One request's part of a step: `token_ids` at positions start .. start+len-1. Read only;
    a NamedTuple (one is made per request per step: a frozen dataclass cost ~4x more to make)."""

    token_ids: Sequence[int]
    start: int
    page_tables: Mapping[str, Sequence[int]]  # paged component -> page ids (-1: released page); read only
    slots: dict[str, int]  # slot component -> slot index
    # (k, {slot component -> checkpoint row}): also write each slot's state as it is after the
    # slice's first k tokens (0 < k < len) into that row of the component's checkpoint pool
    capture: tuple[int, Mapping[str, int]] | None = None


# The longest key tile a paged attention kernel reads at once (vllm-flash-attn 2.6's kBlockN
# is at most 256 rows). Its 2.6.2 kernels look up the block table for every row of a
# sequence's last tile, also past the sequence's last page (fixed upstream later), so the
# block table is padded to whole tiles.
KV_TILE_ROWS = 256


@dataclass
class AttnIndex:
    write_rows: torch.Tensor  # (N,) pool row of each of the step's N tokens, in `ForwardBatch.token_index` order
    read_rows: torch.Tensor  # (B, K) pool row of each visible key, 0 where invalid
    pad_keys: torch.Tensor  # (M,) long: flat index into (B * K) of every invalid key (computed on the host)
    key_pos: torch.Tensor  # (B, K) token position of each key
    key_valid: torch.Tensor  # (B, K) bool
    page_table: torch.Tensor  # (B, P) long, -1 where a page is not held
    block_cols: int = 0  # the block table's width: pages covering the longest context in whole tiles
    # a kernel's per-step derived tensors (e.g. SDPA's visibility mask per window), computed by
    # the first layer that needs one and shared by every other layer of the step
    derived: dict = field(default_factory=dict, repr=False, compare=False)

    @cached_property
    def block_table(self) -> torch.Tensor:
        """The page table as a paged kernel's int32 block table, computed once per step.
        Released pages (-1) and the padding to `block_cols` become page 0: they lie before
        the window or past the context, so they are never read unmasked, and the address
        stays inside the pool."""
        pad = max(0, self.block_cols - self.page_table.shape[1])
        return torch.nn.functional.pad(self.page_table.clamp(min=0), (0, pad)).to(torch.int32)


@dataclass
class Capture:
    """The sequences of a step whose recurrent state is also wanted part-way through their
    slice (a prefix-cache checkpoint inside a prefill chunk), n of them."""

    rows: torch.Tensor  # (n,) long: their rows in the batch
    lens: torch.Tensor  # (n,) long: tokens of their slice before the capture point, 0 < lens < q_lens
    slots: dict[str, torch.Tensor]  # slot component -> (n,) long: the rows written in its checkpoint pool
    into: Mapping[str, str]  # slot component -> the key of its checkpoint pool among the forward's pools


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
    capture: Capture | None = None  # states also wanted inside the step (None: none)

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


_TOKEN_IDS, _START, _SLOTS, _PAGE_TABLES = (attrgetter(f) for f in ("token_ids", "start", "slots", "page_tables"))


def _valid_rows(name: str, rows: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """`rows` where `valid`, else 0; a valid position on a page that is not allocated (a
    negative page, so a negative row) is an error."""
    if ((rows < 0) & valid).any():
        raise RuntimeError(f"{name}: a step touches a position whose page is not allocated")
    return np.where(valid, rows, 0)


def _ragged(rows: list[list[int]], width: int, fill: int) -> np.ndarray:
    """(len(rows), width) int64 array of the rows left-aligned, `fill` after each: one copy
    of all the values, not one small array per row."""
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), width), fill, dtype=np.int64)
    out[np.arange(width)[None, :] < lens[:, None]] = np.fromiter(chain.from_iterable(rows), dtype=np.int64,
                                                                  count=int(lens.sum()))
    return out


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """A host tensor on `device`, by a copy the host does not wait for: `non_blocking` from
    pinned memory on CUDA (a copy from pageable memory waits for the stream first)."""
    device = torch.device(device)
    if device.type == "cuda" and host.device.type == "cpu" and not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


# On a CPU device `to_device` makes each array a tensor without a copy (packing them, 0.3-0.5 ms
# a step, only pays where there is a bus). tests/unit/test_host_syncs.py counts the CUDA route's
# host waits on the CPU and sets this to take that route.
PACK_ON_CPU = False


def to_device(host: dict[str, np.ndarray], device: torch.device | str) -> dict[str, torch.Tensor]:
    """The same arrays (integer or bool, any shapes) as tensors on `device`, moved in ONE copy:
    packed into one int64 host buffer (pinned on CUDA), `upload`ed, and split there into views
    (bool fields converted on the device). On a CPU device (unless PACK_ON_CPU), each array
    as a tensor sharing its memory."""
    device = torch.device(device)
    if device.type == "cpu" and not PACK_ON_CPU:  # the host is the device: each array as it is (fresh), no copy
        return {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in host.items()}
    sizes = [a.size for a in host.values()]
    buf = torch.empty(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
    flat, at = buf.numpy(), 0
    for a, n in zip(host.values(), sizes):
        flat[at:at + n] = a.reshape(-1)
        at += n
    out = {}
    for (name, a), part in zip(host.items(), upload(buf, device).split(sizes)):
        view = part.view(a.shape)
        out[name] = view.bool() if a.dtype == np.bool_ else view
    return out


def _filled(input_ids: np.ndarray, q_lens: np.ndarray, fills: Sequence[int]) -> np.ndarray:
    """`input_ids` with each slice's negative last token (the in-flight placeholder) replaced by
    its row's `fills` value; a placeholder anywhere else, or one with no value, is an error."""
    neg = input_ids < 0
    if not neg.any():
        return input_ids
    rows, cols = np.nonzero(neg)
    values = np.asarray(fills, dtype=np.int64)[rows]
    if (cols != q_lens[rows] - 1).any() or (values < 0).any():
        raise KeyError(f"no sampled token for the placeholder of batch rows {rows[values < 0].tolist()} "
                       f"(or a placeholder before a slice's last token)")
    input_ids[rows, cols] = values
    return input_ids


def build_forward_batch(
    seqs: Sequence, components: tuple[ComponentSpec, ...], page_size: int, device: torch.device | str = "cpu",
    capture_into: Mapping[str, str] | None = None, *,
    captures: Mapping[int, tuple[int, Mapping[str, int]]] | None = None, fills: Sequence[int] | None = None,
) -> ForwardBatch:
    """The step's batch on `device`, computed on the host (numpy) and moved in one copy (`to_device`).
    `seqs`: `SeqSlice`s, or anything with their first four fields (a plan's entries).
    `capture_into`: slot component -> its checkpoint pool's key, needed when a slice captures.
    `captures`: {row: capture} instead of each SeqSlice's own; `fills`: per row, the token a
    negative last token stands for (`_filled`)."""
    if not seqs:
        raise ValueError("empty batch")
    B = len(seqs)
    # per-request fields read with map + C getters: a generator per field cost ~2x as much
    ids = list(map(_TOKEN_IDS, seqs))
    q_lens = np.fromiter(map(len, ids), dtype=np.int64, count=B)
    starts = np.fromiter(map(_START, seqs), dtype=np.int64, count=B)
    ctx = starts + q_lens  # tokens in context after this step
    T, max_context = int(q_lens.max()), int(ctx.max())
    ar_t = np.arange(T)
    q_valid = ar_t[None, :] < q_lens[:, None]
    positions = np.where(q_valid, starts[:, None] + ar_t[None, :], 0)
    token_index = np.flatnonzero(q_valid)  # on the host: no device sync
    input_ids = _ragged(ids, T, 0)
    if fills is not None:
        input_ids = _filled(input_ids, q_lens, fills)
    host = {"input_ids": input_ids, "positions": positions, "q_valid": q_valid,
            "q_lens": q_lens, "token_index": token_index, "context_lens": ctx}
    max_tiles = -(-max_context // KV_TILE_ROWS)
    rows_b = np.arange(B)[:, None]
    slot_names, paged = [], []
    slot_maps, table_maps = list(map(_SLOTS, seqs)), list(map(_PAGE_TABLES, seqs))
    for comp in components:
        if not comp.paged:
            host[comp.name] = np.fromiter(map(itemgetter(comp.name), slot_maps), dtype=np.int64, count=B)
            slot_names.append(comp.name)
            continue
        tables = list(map(itemgetter(comp.name), table_maps))
        n_pages = max(1, max(map(len, tables)))
        pt = _ragged(tables, n_pages, -1)

        def rows_at(pos: np.ndarray, valid: np.ndarray, pt=pt) -> np.ndarray:
            """Pool rows of token positions `pos` (B, n); where not `valid`, 0."""
            page = pt[rows_b, np.minimum(pos // page_size, n_pages - 1)]  # pos >= 0
            return _valid_rows(comp.name, page * page_size + pos % page_size, valid)

        read_start = np.maximum(starts - comp.window + 1, 0) if comp.kind == WINDOW else np.zeros_like(starts)
        n_keys = ctx - read_start
        K = int(n_keys.max())
        key_pos = read_start[:, None] + np.arange(K)[None, :]
        key_valid = np.arange(K)[None, :] < n_keys[:, None]
        if n_pages * page_size >= K and not read_start.any():
            # every request's keys are its positions 0 .. K-1: each page's rows in order, without a
            # page lookup per key (the same rows as rows_at; a third of its cost at 64 x 80 keys)
            every = (pt[:, :, None] * page_size + np.arange(page_size)).reshape(B, n_pages * page_size)[:, :K]
            read_rows = _valid_rows(comp.name, every, key_valid)
        else:
            read_rows = rows_at(key_pos, key_valid)
        paged.append(comp.name)
        host.update({
            f"{comp.name}.write_rows": rows_at(positions, q_valid).reshape(-1)[token_index],
            f"{comp.name}.read_rows": read_rows,
            f"{comp.name}.pad_keys": np.flatnonzero(~key_valid),
            f"{comp.name}.key_pos": key_pos, f"{comp.name}.key_valid": key_valid, f"{comp.name}.page_table": pt,
        })
    captured = (sorted(captures.items()) if captures is not None
                else [(b, s.capture) for b, s in enumerate(seqs) if s.capture is not None])
    if captured:
        if capture_into is None or any(not 0 < k < q_lens[b] for b, (k, _) in captured):
            raise ValueError(f"invalid captures {[(b, k, int(q_lens[b])) for b, (k, _) in captured]} "
                             f"(checkpoint pools: {capture_into})")
        host["capture.rows"] = np.fromiter((b for b, _ in captured), dtype=np.int64, count=len(captured))
        host["capture.lens"] = np.fromiter((k for _, (k, _) in captured), dtype=np.int64, count=len(captured))
        for name in slot_names:
            host[f"capture.{name}"] = np.fromiter((rows[name] for _, (_, rows) in captured), dtype=np.int64,
                                                  count=len(captured))
    dev = to_device(host, device)
    capture = Capture(dev["capture.rows"], dev["capture.lens"], {name: dev[f"capture.{name}"] for name in slot_names},
                      capture_into) if captured else None
    attn = {name: AttnIndex(
        write_rows=dev[f"{name}.write_rows"], read_rows=dev[f"{name}.read_rows"], pad_keys=dev[f"{name}.pad_keys"],
        key_pos=dev[f"{name}.key_pos"],
        key_valid=dev[f"{name}.key_valid"], page_table=dev[f"{name}.page_table"],
        block_cols=-(-max_tiles * KV_TILE_ROWS // page_size),
    ) for name in paged}
    return ForwardBatch(
        input_ids=dev["input_ids"], positions=dev["positions"], q_valid=dev["q_valid"], q_lens=dev["q_lens"],
        token_index=dev["token_index"], attn=attn, slots={name: dev[name] for name in slot_names},
        page_size=page_size, context_lens=dev["context_lens"], max_context=max_context, capture=capture,
    )
