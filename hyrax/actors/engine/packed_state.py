"""A request's state on one rank packed into one buffer: every component's rows back to back,
each starting on a hash row, so that one row-sum pass hashes every component at once.

A save gathers each component's rows straight into its part of the buffer and hashes the
whole buffer with two matrix-vector products (state_hash.DeviceHasher.packed); a restore
writes each part into the pools, gathers the written rows into a second packed buffer and
hashes that the same way. A few torch calls per move instead of a dozen per component (each
costs ~3-5 us on one CPU core here, which at a few hundred KB per request is more than the
bytes themselves).

Buffer: `(rows, ROW_WORDS)` int64, `rows` = the sum over parts of their hash rows. Part p
occupies hash rows `first[p] .. first[p] + rows[p] - 1`; its bytes start at the first of them,
in the part's row-major order, and the rest of its last hash row is zero. Those zeros are what
the hash definition pads with, so the row sums over a part's hash rows are exactly the row
sums of the part hashed alone, and its hash is the same value `state_hash` gives.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from hyrax.actors.engine.state_hash import ROW_WORDS, DeviceHasher, row_weights, with_length
from hyrax.actors.model.row_copy import wide_dtype

HASH_ROW_BYTES = ROW_WORDS * 8
DENSE_MAX = 1 << 16  # entries of a packing's (parts, hash rows) weight matrix: 512 KiB, states up to ~32 MB
Spec = tuple[tuple[str, tuple[int, ...], torch.dtype], ...]  # (name, shape, dtype) per part, in order


@dataclass(frozen=True)
class Part:
    name: str
    shape: tuple[int, ...]  # (layers, rows, *unit)
    dtype: torch.dtype
    first: int  # first hash row of the part in the buffer
    nbytes: int

    @property
    def hash_rows(self) -> int:
        return -(-self.nbytes // HASH_ROW_BYTES)


class Packing:
    """Where each part of one spec lies in a packed buffer, and how to hash it on the device.

    `hash(words)`: (parts,) int64, each part's hash before its length term. Chosen here by size:
    up to DENSE_MAX (parts x hash rows) entries, one matrix-vector product with `weights`
    (parts, rows) int64, whose row p holds the row weights v[0 .. rows[p] - 1] at the part's
    hash rows and zeros elsewhere; beyond that (a matrix that would grow with the state, kept
    per cached spec) one dot per part with a prefix of v, whose per-call cost is small there.
    pad: (k,) int64, the last hash row of each part that does not fill it.
    """

    def __init__(self, spec: Spec, hasher: DeviceHasher):
        parts, first = [], 0
        for name, shape, dtype in spec:
            part = Part(name, tuple(shape), dtype, first, math.prod(shape) * dtype.itemsize)
            parts.append(part)
            first += part.hash_rows
        self.parts = tuple(parts)
        self.rows = first
        self.names = tuple(p.name for p in parts)
        self.hasher = hasher
        if len(parts) * first <= DENSE_MAX:
            weights = np.zeros((len(parts), first), dtype=np.int64)
            for k, p in enumerate(parts):
                weights[k, p.first:p.first + p.hash_rows] = row_weights(p.hash_rows)
            self.weights = torch.from_numpy(weights).to(hasher.device)
            self.hash = self._hash_dense
        else:
            self.hash = self._hash_by_part
        pad = [p.first + p.hash_rows - 1 for p in parts if p.nbytes % HASH_ROW_BYTES]
        self.pad = torch.tensor(pad, dtype=torch.int64, device=hasher.device) if pad else None
        self.nbytes = {p.name: p.nbytes for p in parts}
        self._strides = [_contiguous_strides(p.shape) for p in parts]

    def _hash_dense(self, words: torch.Tensor) -> torch.Tensor:
        """words: (rows, ROW_WORDS) int64 -> (parts,) int64 on the device, not read."""
        return self.hasher.packed(words, self.weights)

    def _hash_by_part(self, words: torch.Tensor) -> torch.Tensor:
        h = self.hasher
        sums = h.row_sums(words, h.word_weights)  # (rows,)
        v = h.row_weight_prefix(max(p.hash_rows for p in self.parts))
        return torch.stack([h.dot(sums[p.first:p.first + p.hash_rows], v[:p.hash_rows]) for p in self.parts])

    def clear_padding(self, words: torch.Tensor) -> None:
        """words: (rows, ROW_WORDS) int64. Zero the last hash row of each part that its bytes do
        not fill (before the parts are written: they overwrite the rest)."""
        if self.pad is not None:
            words.index_fill_(0, self.pad, 0)

    def views(self, words: torch.Tensor) -> dict[str, torch.Tensor]:
        """words: (rows, ROW_WORDS) int64 -> each part as a (layers, rows, *unit) view of it."""
        by_dtype: dict[torch.dtype, tuple[torch.Tensor, int]] = {}  # words as that dtype, its storage offset
        out = {}
        for p, stride in zip(self.parts, self._strides):
            typed = by_dtype.get(p.dtype)
            if typed is None:
                t = words.view(p.dtype)  # (rows, ROW_WORDS * 8 / itemsize): as_strided takes any shape
                typed = by_dtype[p.dtype] = (t, t.storage_offset())
            out[p.name] = typed[0].as_strided(p.shape, stride, typed[1] + p.first * HASH_ROW_BYTES // p.dtype.itemsize)
        return out

    def read(self, sums: torch.Tensor | list[int]) -> dict[str, int]:
        """sums: (parts,) int64 from `DeviceHasher.packed` (or already read: ints) -> each part's
        state hash (one host read)."""
        raw = sums.tolist() if isinstance(sums, torch.Tensor) else sums
        return self.read_parts(dict(zip(self.names, raw)))

    def read_parts(self, sums: dict[str, int]) -> dict[str, int]:
        """sums: some parts' hashes before their length terms, by name -> their state hashes."""
        return {name: with_length(h, self.nbytes[name]) for name, h in sums.items()}


class Packings:
    """The packings of one device, made once per spec (the most recent `size` are kept: a
    request's state has the same spec from one move to the next at the same length)."""

    def __init__(self, hasher: DeviceHasher, size: int = 64):
        self.hasher = hasher
        self.size = size
        self._made: OrderedDict[Spec, Packing] = OrderedDict()

    def __call__(self, spec: Spec) -> Packing:
        p = self._made.get(spec)
        if p is None:
            p = self._made[spec] = Packing(spec, self.hasher)
            if len(self._made) > self.size:
                self._made.popitem(last=False)
        else:
            self._made.move_to_end(spec)
        return p


@dataclass
class PackedState:
    """Rows of several components in one packed host buffer (a backup, or a host-pool read)."""

    words: torch.Tensor  # (rows, ROW_WORDS) int64
    packing: Packing
    parts: dict[str, torch.Tensor]  # component -> (layers, rows, *unit) view of `words`


def row_view(pool: torch.Tensor) -> torch.Tensor:
    """pool: (layers, rows, *unit), contiguous -> the same bytes as (layers, rows, k) of the widest
    element type that divides a row's bytes (k elements: a move copies whole rows, bit for bit;
    index_copy_ moves a row element by element, ~3x slower at 4 B than at 16 B: row_copy.py)."""
    unit = math.prod(pool.shape[2:])
    row_bytes = unit * pool.element_size()
    dtype = wide_dtype(row_bytes, pool)
    return pool.view(*pool.shape[:2], unit).view(torch.uint8).view(dtype)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, n = [], 1
    for d in reversed(shape):
        strides.append(n)
        n *= d
    return tuple(reversed(strides))
