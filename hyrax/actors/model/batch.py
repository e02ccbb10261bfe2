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
from itertools import chain, repeat
from operator import attrgetter, itemgetter
from typing import Mapping, NamedTuple, Sequence

import numpy as np
import torch

from hyrax.actors.model.components import WINDOW, ComponentSpec

PLACEHOLDER = -1  # a token still being sampled (engine/plan.py): `fills` says which


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


@dataclass(frozen=True)
class KeyLayout:
    """Where a step's keys are: row b's keys are positions first[b] .. first[b] + n_keys[b] - 1
    (K columns, the longest row's count), on the pages of the page table."""

    first: torch.Tensor | None  # (B,) long on the device; None: every row's keys start at position 0
    n_keys: torch.Tensor  # (B,) long on the device
    K: int
    page_size: int


class AttnIndex:
    """A paged component's view of a step: where its tokens are written, which pool rows its
    keys are read from. The per-key tensors (read_rows, key_pos, key_valid: (B, K) each) are
    derived on the device from the page table and the `KeyLayout` when first read - by the
    first attention layer of the step, shared by the others - as a paged kernel reads the
    block table itself: the host builds O(B * P) metadata, not O(B * K). They may also be
    given (`with_keys`)."""

    def __init__(self, write_rows: torch.Tensor, pad_keys: torch.Tensor, page_table: torch.Tensor,
                 block_cols: int = 0, *, keys: KeyLayout | None = None, read_rows: torch.Tensor | None = None,
                 key_pos: torch.Tensor | None = None, key_valid: torch.Tensor | None = None):
        self.write_rows = write_rows  # (N,) pool row of each of the step's N tokens, in `ForwardBatch.token_index` order
        self.pad_keys = pad_keys  # (M,) long: flat index into (B * K) of every invalid key (computed on the host)
        self.page_table = page_table  # (B, P) long, -1 where a page is not held
        self.block_cols = block_cols  # the block table's width: pages covering the longest context in whole tiles
        self.keys = keys
        if (read_rows is None or key_pos is None or key_valid is None) and keys is None:
            raise ValueError("AttnIndex needs a key layout or the per-key tensors")
        self._read_rows, self._key_pos, self._key_valid = read_rows, key_pos, key_valid
        # a kernel's per-step derived tensors (e.g. SDPA's visibility mask per window), computed by
        # the first layer that needs one and shared by every other layer of the step
        self.derived: dict = {}

    @property
    def read_rows(self) -> torch.Tensor:
        """(B, K) pool row of each key, 0 where invalid."""
        if self._read_rows is None:
            self._derive()
        return self._read_rows

    @property
    def key_pos(self) -> torch.Tensor:
        """(B, K) token position of each key."""
        if self._key_pos is None:
            self._derive()
        return self._key_pos

    @property
    def key_valid(self) -> torch.Tensor:
        """(B, K) bool."""
        if self._key_valid is None:
            self._derive()
        return self._key_valid

    def _derive(self) -> None:
        lay, pt = self.keys, self.page_table
        B, P = pt.shape
        ps, K = lay.page_size, lay.K
        ar = torch.arange(K, device=pt.device)
        pos = ar.expand(B, K) if lay.first is None else lay.first[:, None] + ar
        valid = ar < lay.n_keys[:, None]
        if lay.first is None and P * ps >= K:  # each page's rows in order: no page lookup per key
            rows = (pt.clamp(min=0)[:, :, None] * ps + torch.arange(ps, device=pt.device)).view(B, P * ps)[:, :K]
        else:
            page = pt.gather(1, torch.clamp(pos // ps, max=P - 1)).clamp(min=0)
            rows = page * ps + pos % ps
        self._read_rows = torch.where(valid, rows, 0)
        self._key_pos, self._key_valid = pos, valid

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the attention may read (the per-key ones derived if they were not given),
        the key layout's too (a paged kernel reads the counts and first positions)."""
        lay = () if self.keys is None else tuple(t for t in (self.keys.first, self.keys.n_keys) if t is not None)
        return (self.write_rows, self.read_rows, self.pad_keys, self.key_pos, self.key_valid, self.page_table) + lay

    def with_keys(self, **tensors: torch.Tensor) -> AttnIndex:
        """A copy with some of read_rows, key_pos, key_valid, pad_keys given (fresh derived tensors)."""
        out = AttnIndex(tensors.get("write_rows", self.write_rows), tensors.get("pad_keys", self.pad_keys),
                        tensors.get("page_table", self.page_table), self.block_cols, keys=self.keys,
                        read_rows=tensors.get("read_rows", self.read_rows), key_pos=tensors.get("key_pos", self.key_pos),
                        key_valid=tensors.get("key_valid", self.key_valid))
        return out

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
    lens_host: tuple[int, ...] = ()  # `lens` on the host (a token-by-token recurrence stops at each)

    @cached_property
    def at_token(self) -> dict[int, torch.Tensor]:
        """Token index t -> (m,) long: the captures whose point is right after token t of their
        slice (lens == t + 1), as indices into rows / slots; made once per step for every layer."""
        by: dict[int, list[int]] = {}
        for i, k in enumerate(self.lens_host):
            by.setdefault(k - 1, []).append(i)
        return {t: torch.tensor(ix, dtype=torch.long, device=self.rows.device) for t, ix in by.items()}


class Segment(NamedTuple):
    """One pass of a step kernel that stops at capture points (`capture_segments`): some of the
    step's sequences, each over a run of its slice's tokens, with the state rows involved made
    once per step for every layer."""

    rows: torch.Tensor  # (m,) long: the sequences, as rows of the whole step
    starts: torch.Tensor  # (m,) long: where each one's run begins among the step's packed tokens
    lens: torch.Tensor  # (m,) long: the run's tokens, at least one
    slots: dict[str, torch.Tensor]  # slot component -> (m,) long: the sequences' rows of it
    # the captures whose point ends a run of this pass (none: both empty): per slot component, the
    # checkpoint rows they write and the slot rows they copy, (c,) long each
    into: dict[str, torch.Tensor]
    sources: dict[str, torch.Tensor]


def capture_segments(q_lens: Sequence[int], starts: Sequence[int], capture: Capture,
                     slots: Mapping[str, torch.Tensor], row_offset: int = 0) -> list[Segment]:
    """A step's slices cut at their capture points, as passes: pass i runs each sequence's i-th
    run (a sequence with no capture point has one run, its whole slice; one with c of them,
    c + 1), so that a kernel that carries a sequence's state in its rows, run pass after pass,
    leaves in those rows after every pass the state at each capture point that pass ended at.
    `capture`'s rows are rows of the step plus `row_offset` (a MixedBatch's slices follow its
    decode rows); `slots`: the step's rows of each slot component."""
    cuts: dict[int, list[tuple[int, int]]] = {}  # row -> [(capture point, capture index)]
    for i, (b, k) in enumerate(zip(capture.rows.tolist(), capture.lens_host)):
        cuts.setdefault(b + row_offset, []).append((k, i))
    runs: list[list[tuple[int, int, int, list[int]]]] = []  # pass -> [(row, start, len, captures ending it)]
    for b, (n, start) in enumerate(zip(q_lens, starts)):
        ends = sorted(cuts.get(b, ()))
        done = at = i = 0  # tokens run, capture points passed, runs made
        while done < n:
            end = ends[at][0] if at < len(ends) else n
            ending = []
            while at < len(ends) and ends[at][0] == end:
                ending.append(ends[at][1])
                at += 1
            if i == len(runs):
                runs.append([])
            runs[i].append((b, start + done, end - done, ending))
            done, i = end, i + 1
    device = capture.rows.device

    def longs(values) -> torch.Tensor:
        return torch.tensor(list(values), dtype=torch.long, device=device)

    def segment(run: list[tuple[int, int, int, list[int]]]) -> Segment:
        rows = longs(r[0] for r in run)
        ended = [(c, b) for b, _, _, cs in run for c in cs]
        into, sources = {}, {}
        if ended:
            which, seqs = longs(c for c, _ in ended), longs(b for _, b in ended)
            into = {name: capture.slots[name].index_select(0, which) for name in slots}
            sources = {name: s.index_select(0, seqs) for name, s in slots.items()}
        return Segment(rows, longs(r[1] for r in run), longs(r[2] for r in run),
                       {name: s.index_select(0, rows) for name, s in slots.items()}, into, sources)

    return [segment(run) for run in runs]


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
    def packs(self) -> bool:
        """Whether this step runs packed (HybridModel.forward): several slices of more than one
        token, some padded. Known on the host (the token count is a shape)."""
        B, T = self.input_ids.shape
        return T > 1 and self.token_index.shape[0] < B * T

    @cached_property
    def starts(self) -> torch.Tensor:
        """(B,) long: where each sequence's tokens begin among the N packed tokens."""
        return self.q_lens.cumsum(0) - self.q_lens

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """(B, T, ...) -> (1, N, ...): the real tokens, sequence by sequence, padding dropped."""
        B, T = self.input_ids.shape
        return x.reshape(B * T, *x.shape[2:]).index_select(0, self.token_index)[None]

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """(1, N, ...) -> (B, T, ...): the tokens back in their rows, zeros at padding."""
        B, T = self.input_ids.shape
        out = x.new_zeros(B * T, *x.shape[2:])
        return out.index_copy_(0, self.token_index, x[0]).view(B, T, *x.shape[2:])

    def packed_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The real tokens' input ids and positions, (1, N) each, sequence by sequence."""
        return (self.input_ids.reshape(-1).index_select(0, self.token_index)[None],
                self.positions.reshape(-1).index_select(0, self.token_index)[None])

    def write_rows(self, component: str) -> torch.Tensor:
        """(N,) the pool rows of `component` the step's real tokens write, in packed order."""
        return self.attn[component].write_rows

    def by_rows(self, fn, x: torch.Tensor) -> torch.Tensor:
        """Packed x (1, N, ...) -> (1, N, ...): `fn(rows, batch)` on x's (B, T) rows and this
        batch, its result packed again (attention's backend, a mixer that cannot run packed
        tokens)."""
        return self.pack(fn(self.unpack(x), self))

    @property
    def num_seqs(self) -> int:
        return self.input_ids.shape[0]

    @cached_property
    def segments(self) -> list[Segment]:
        """The step's slices cut at its capture points (`capture_segments`), in the packed
        layout; made once per step for every layer. Only with a capture."""
        return capture_segments(self.q_lens.tolist(), self.starts.tolist(), self.capture, self.slots)

    @property
    def max_len(self) -> int:
        return self.input_ids.shape[1]


@dataclass
class MixedBatch:
    """A step's decode rows and its prompt slices in ONE packed forward (HybridModel.forward):
    the token-wise work - embedding, norms, projections, MLPs, the C Mamba2 step - runs once on
    all their tokens, (1, nd + N, hidden), the decode tokens first; attention, and any mixer
    that needs (B, T) rows, runs each part as the batch it is (`by_rows`): the decode
    rows as a decode step, the slices unpacked, so a decode token is never padded to the
    longest slice. The parts are ordinary batches (`build_forward_batch`): every row's
    metadata is what it would be in a forward of its own part."""

    decode: ForwardBatch  # nd rows of one token each
    chunks: ForwardBatch  # the prompt slices (at least one longer than a token)
    packs = True  # always runs packed

    def __post_init__(self):
        if self.decode.max_len != 1 or self.chunks.max_len < 2:
            raise ValueError("a mixed batch is decode rows of one token and slices of which one is longer")
        self._write_rows: dict[str, torch.Tensor] = {}

    @property
    def num_decode(self) -> int:
        return self.decode.num_seqs

    @property
    def num_seqs(self) -> int:
        return self.decode.num_seqs + self.chunks.num_seqs

    @property
    def max_len(self) -> int:
        return self.chunks.max_len

    @property
    def capture(self) -> Capture | None:
        """The slices' capture points (a decode token has none), as rows of `chunks`: a mixer
        that captures runs each part on its own rows (`by_rows`)."""
        return self.chunks.capture

    @cached_property
    def q_lens(self) -> torch.Tensor:
        return torch.cat([self.decode.q_lens, self.chunks.q_lens])

    @cached_property
    def starts(self) -> torch.Tensor:
        """(B,) long: where each sequence's tokens begin among the packed tokens."""
        return torch.cat([self.decode.starts, self.chunks.starts + self.num_decode])

    @cached_property
    def slots(self) -> dict[str, torch.Tensor]:
        return {name: torch.cat([s, self.chunks.slots[name]]) for name, s in self.decode.slots.items()}

    @cached_property
    def segments(self) -> list[Segment]:
        """As `ForwardBatch.segments`, over the decode rows and the slices (whose capture rows
        count from the first slice)."""
        return capture_segments(self.q_lens.tolist(), self.starts.tolist(), self.capture, self.slots,
                                self.num_decode)

    def packed_inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        (di, dp), (ci, cp) = self.decode.packed_inputs(), self.chunks.packed_inputs()
        return torch.cat([di, ci], dim=1), torch.cat([dp, cp], dim=1)

    def write_rows(self, component: str) -> torch.Tensor:
        rows = self._write_rows.get(component)
        if rows is None:  # made by the first attention layer of the component, shared by the others
            rows = self._write_rows[component] = torch.cat([self.decode.write_rows(component),
                                                            self.chunks.write_rows(component)])
        return rows

    def by_rows(self, fn, x: torch.Tensor) -> torch.Tensor:
        """`fn` on each part's rows: the decode rows as (nd, 1, ...), the slices unpacked."""
        nd = self.num_decode
        head = fn(x[0, :nd, None], self.decode)
        return torch.cat([head.view(1, nd, *head.shape[2:]), self.chunks.by_rows(fn, x[:, nd:])], dim=1)


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


class _Rows(NamedTuple):
    """Per-row host arrays of a step: query lengths, start positions, input ids (B, T), and each
    component's page tables (B, P) or slots (B,)."""

    q_lens: np.ndarray
    starts: np.ndarray
    input_ids: np.ndarray
    units: dict[str, np.ndarray]


def _row_inputs(seqs: Sequence, block, components: tuple[ComponentSpec, ...], fills: Sequence[int] | None) -> _Rows:
    """The rows of `block` (columns: no per-row step), then those of `seqs`."""
    nb, ns = (len(block) if block is not None else 0), len(seqs)
    if nb and not ns:  # a steady decode step: the block's columns as they are
        tokens = block.tokens if block.tokens is not None else np.full(nb, PLACEHOLDER, dtype=np.int64)
        q_lens = np.ones(nb, dtype=np.int64)
        input_ids = tokens.reshape(nb, 1)
        if fills is not None and block.tokens is None:
            input_ids = _filled(input_ids, q_lens, fills)
        slots = block.slots
        return _Rows(q_lens, block.starts, input_ids, {c.name: (block.tables if c.paged else slots)[c.name]
                                                       for c in components})
    # per-request fields read with map + C getters: a generator per field cost ~2x as much
    ids = list(map(_TOKEN_IDS, seqs))
    q_lens = np.fromiter(chain(repeat(1, nb), map(len, ids)), dtype=np.int64, count=nb + ns)
    starts = np.fromiter(map(_START, seqs), dtype=np.int64, count=ns)
    T = int(q_lens.max())
    input_ids = _ragged(ids, T, 0)
    if nb:
        starts = np.concatenate([block.starts, starts])
        head = np.zeros((nb, T), dtype=np.int64)
        head[:, 0] = block.tokens if block.tokens is not None else PLACEHOLDER
        input_ids = np.concatenate([head, input_ids])
    if fills is not None:
        input_ids = _filled(input_ids, q_lens, fills)
    units = {}
    slot_maps, table_maps = list(map(_SLOTS, seqs)), list(map(_PAGE_TABLES, seqs))
    for comp in components:
        if not comp.paged:
            units[comp.name] = np.fromiter(map(itemgetter(comp.name), slot_maps), dtype=np.int64, count=ns)
            if nb:
                units[comp.name] = np.concatenate([block.slots[comp.name], units[comp.name]])
            continue
        tables = list(map(itemgetter(comp.name), table_maps))
        width = max(1, max(map(len, tables), default=0), block.tables[comp.name].shape[1] if nb else 0)
        pt = _ragged(tables, width, -1)
        if nb:
            head = block.tables[comp.name]
            if head.shape[1] < width:
                head = np.pad(head, ((0, 0), (0, width - head.shape[1])), constant_values=-1)
            pt = np.concatenate([head, pt])
        units[comp.name] = pt
    return _Rows(q_lens, starts, input_ids, units)


def build_forward_batch(
    seqs: Sequence, components: tuple[ComponentSpec, ...], page_size: int, device: torch.device | str = "cpu",
    capture_into: Mapping[str, str] | None = None, *,
    captures: Mapping[int, Sequence[tuple[int, Mapping[str, int]]]] | None = None, fills: Sequence[int] | None = None,
    block=None,
) -> ForwardBatch:
    """The step's batch on `device`, computed on the host (numpy) and moved in one copy (`to_device`).
    `seqs`: `SeqSlice`s, or anything with their first four fields (a plan's entries); `block`: a
    plan's `DecodeBlock`, whose rows come first. `capture_into`: slot component -> its
    checkpoint pool's key, needed when a slice captures. `captures`: {row: [capture, ...]}
    (several points of one slice allowed) instead of each SeqSlice's own; `fills`: per row, the token a negative last token stands for (`_filled`)."""
    if not seqs and not block:
        raise ValueError("empty batch")
    rows = _row_inputs(seqs, block, components, fills)
    q_lens, starts = rows.q_lens, rows.starts
    B = len(q_lens)
    ctx = starts + q_lens  # tokens in context after this step
    T, max_context = rows.input_ids.shape[1], int(ctx.max())
    ar_t = np.arange(T)
    q_valid = ar_t[None, :] < q_lens[:, None]
    positions = np.where(q_valid, starts[:, None] + ar_t[None, :], 0)
    token_index = np.flatnonzero(q_valid)  # on the host: no device sync
    host = {"input_ids": rows.input_ids, "positions": positions, "q_valid": q_valid,
            "q_lens": q_lens, "token_index": token_index, "context_lens": ctx}
    max_tiles = -(-max_context // KV_TILE_ROWS)
    rows_b = np.arange(B)[:, None]
    slot_names, paged = [], []
    for comp in components:
        if not comp.paged:
            host[comp.name] = rows.units[comp.name]
            slot_names.append(comp.name)
            continue
        pt = rows.units[comp.name]
        n_pages = pt.shape[1]

        def rows_at(pos: np.ndarray, valid: np.ndarray, pt=pt) -> np.ndarray:
            """Pool rows of token positions `pos` (B, n); where not `valid`, 0."""
            page = pt[rows_b, np.minimum(pos // page_size, n_pages - 1)]  # pos >= 0
            return _valid_rows(comp.name, page * page_size + pos % page_size, valid)

        read_start = np.maximum(starts - comp.window + 1, 0) if comp.kind == WINDOW else None
        if read_start is not None and not read_start.any():
            read_start = None  # every request's keys start at position 0
        n_keys = ctx if read_start is None else ctx - read_start
        K = int(n_keys.max())
        # every key's page is held: checked per page (B x P), the keys themselves are derived on
        # the device (AttnIndex)
        first_page = 0 if read_start is None else (read_start // page_size)[:, None]
        last_page = ((ctx - 1) // page_size)[:, None]
        ar_p = np.arange(n_pages)[None, :]
        if ((pt < 0) & (ar_p >= first_page) & (ar_p <= last_page)).any() or (last_page >= n_pages).any():
            raise RuntimeError(f"{comp.name}: a step touches a position whose page is not allocated")
        paged.append((comp.name, K))
        # the invalid keys (each row's n_keys .. K-1) in flat (B * K) order, from the counts alone
        pads = K - n_keys
        first = np.arange(B) * K + n_keys - (np.cumsum(pads) - pads)
        host.update({
            f"{comp.name}.write_rows": rows_at(positions, q_valid).reshape(-1)[token_index],
            f"{comp.name}.pad_keys": np.repeat(first, pads) + np.arange(int(pads.sum())),
            f"{comp.name}.n_keys": n_keys, f"{comp.name}.page_table": pt,
        })
        if read_start is not None:
            host[f"{comp.name}.first"] = read_start
    captured = ([(b, c) for b, cs in sorted(captures.items()) for c in cs] if captures is not None
                else [(b, s.capture) for b, s in enumerate(seqs, start=B - len(seqs)) if s.capture is not None])
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
                      capture_into, tuple(k for _, (k, _) in captured)) if captured else None
    attn = {name: AttnIndex(
        dev[f"{name}.write_rows"], dev[f"{name}.pad_keys"], dev[f"{name}.page_table"],
        -(-max_tiles * KV_TILE_ROWS // page_size),
        keys=KeyLayout(dev.get(f"{name}.first"), dev[f"{name}.n_keys"], K, page_size),
    ) for name, K in paged}
    return ForwardBatch(
        input_ids=dev["input_ids"], positions=dev["positions"], q_valid=dev["q_valid"], q_lens=dev["q_lens"],
        token_index=dev["token_index"], attn=attn, slots={name: dev[name] for name in slot_names},
        page_size=page_size, context_lens=dev["context_lens"], max_context=max_context, capture=capture,
    )
