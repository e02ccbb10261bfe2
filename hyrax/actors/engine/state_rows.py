"""A request's rows of a CPU state pool moved and hashed in one pass (kernels/state_rows.c).

A backup gathers each component's rows into its part of the packed buffer and hashes them; a
restore writes them into the newly allocated rows and hashes what those rows hold. As torch
operations that is a gather (`index_select`), then one or two passes of an int64 matrix-vector
product over the copy (~4-8 GB/s on one core, where a copy runs 15-25), and on a restore a
second gather of the written rows into a scratch buffer to hash them. The kernel hashes the
bytes while they are in the cache: each whole hash row as soon as it is written (a gather), or
each layer's rows read back right after the layer's writes (a scatter; a row given twice still
shows, as it would in a gather of the written rows).

The value is `state_hash`'s, bit for bit (tests/unit/test_state_rows.py checks it against the
torch form); used on CPU ranks where the kernel builds, with the torch path everywhere else.
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import torch

from hyrax.actors.engine.packed_state import HASH_ROW_BYTES
from hyrax.actors.engine.state_hash import DeviceHasher, with_length
from hyrax.actors.model.native import NativeUnavailable, function, raise_for, unavailable

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGS = [_PTR, _I64, _PTR, _PTR, _PTR]  # moves, count, word weights, row weights, hashes out
_ERRORS = {-1: "a row lies outside the pool"}
MOVE_FIELDS = 7  # a move as the kernel reads it: pool, layers, pool rows, row bytes, rows, n, data


class FusedRowMoves:
    """Gather and scatter of pool rows with the state hash of the moved bytes, on the CPU.
    Pools are (layers, pool rows, k) contiguous views (packed_state.row_view); a part is the
    rows of every layer back to back, layer by layer, as `index_select(1, idx)` lays them out.
    A save or load moves every component of a request in one kernel call (`gather_many`,
    `scatter_many`): a call through ctypes costs several microseconds (tens, with the caches
    cold after a forward), more than the copy of a small component."""

    def __init__(self, hasher: DeviceHasher):
        if hasher.device.type != "cpu":
            raise NativeUnavailable("the fused row moves run on the CPU only")
        self.hasher = hasher
        self._gather = function("state_rows", "hyrax_gather_hash_many", _ARGS)
        self._scatter = function("state_rows", "hyrax_scatter_hash_many", _ARGS)

    def _call(self, fn, moves: Sequence[tuple[torch.Tensor, torch.Tensor, int]], what: str) -> list[int]:
        """moves: (pool, rows, data address) each; the hashes before their length terms."""
        if not moves:
            return []
        table: list[int] = []  # count rows of MOVE_FIELDS
        kept = []  # the row tensors made here live until the kernel has read them
        hash_rows = 1
        for pool, idx, data_ptr in moves:
            if pool.device.type != "cpu" or not pool.is_contiguous() or pool.dim() != 3:
                raise ValueError(f"{what}: the pool must be a contiguous (layers, rows, k) CPU tensor")
            idx = idx.contiguous()
            if idx.dtype != torch.int64 or idx.dim() != 1 or idx.device.type != "cpu":
                raise ValueError(f"{what}: the rows must be a (n,) int64 CPU tensor")
            kept.append(idx)
            layers, pool_rows, k = pool.shape
            row_bytes = k * pool.element_size()
            n = idx.shape[0]
            hash_rows = max(hash_rows, -(-layers * n * row_bytes // HASH_ROW_BYTES))
            table += (pool.data_ptr(), layers, pool_rows, row_bytes, idx.data_ptr(), n, data_ptr)
        v = self.hasher.row_weight_prefix(hash_rows)
        out = (ctypes.c_uint64 * len(moves))()  # per call: a rank's moves may come from more than one thread
        rc = fn((ctypes.c_int64 * len(table))(*table), len(moves), self.hasher.word_weights.data_ptr(),
                v.data_ptr(), out)
        raise_for(rc, what, _ERRORS)
        return list(out)

    def gather_many(self, moves: Sequence[tuple[torch.Tensor, torch.Tensor, int]]) -> list[int]:
        """`gather` of each (pool, idx, out address), in one kernel call; every move's rows are
        checked against its pool before anything is written."""
        return self._call(self._gather, moves, "gather_hash")

    def gather(self, pool: torch.Tensor, idx: torch.Tensor, out_ptr: int) -> int:
        """Rows `idx` of every layer of `pool` written to the bytes at `out_ptr` (layers * n
        rows, nothing past them); returns their hash before the length term
        (`state_hash.with_length` completes it)."""
        return self.gather_many([(pool, idx, out_ptr)])[0]

    def scatter_many(self, moves: Sequence[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> list[int]:
        """`scatter` of each (pool, idx, rows), in one kernel call; every move's rows are checked
        against its pool before anything is written."""
        for pool, idx, rows in moves:
            want = pool.shape[0] * idx.shape[0] * pool.shape[2] * pool.element_size()
            if rows.device.type != "cpu" or not rows.is_contiguous() or rows.numel() * rows.element_size() != want:
                raise ValueError(f"scatter_hash: rows {tuple(rows.shape)} {rows.dtype} do not fit the pool "
                                 f"{tuple(pool.shape)} {pool.dtype} at {idx.shape[0]} rows")
        return self._call(self._scatter, [(pool, idx, rows.data_ptr()) for pool, idx, rows in moves], "scatter_hash")

    def scatter(self, pool: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> int:
        """`rows`, contiguous, laid out as `gather` writes them (layers * n pool rows, layer by
        layer; any dtype), written into rows `idx` of every layer; returns the hash of what those
        rows hold afterwards, before the length term."""
        return self.scatter_many([(pool, idx, rows)])[0]


def fused_row_moves(hasher: DeviceHasher) -> FusedRowMoves | None:
    """The fused moves for a CPU hasher, or None (another device, no C compiler, a failed
    build): the caller keeps its torch operations."""
    try:
        return FusedRowMoves(hasher)
    except NativeUnavailable:
        return None


def available() -> str | None:
    """None when the kernel builds and loads here, else why not (`hyrax doctor`)."""
    return unavailable("state_rows")
