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

import torch

from hyrax.actors.engine.packed_state import HASH_ROW_BYTES
from hyrax.actors.engine.state_hash import DeviceHasher, with_length
from hyrax.actors.model.native import NativeUnavailable, function, raise_for, unavailable

_I64, _PTR = ctypes.c_int64, ctypes.c_void_p
_ARGS = [_PTR, _I64, _I64, _I64, _PTR, _I64, _PTR, _PTR, _PTR, _PTR]
_ERRORS = {-1: "a row lies outside the pool"}


class FusedRowMoves:
    """Gather and scatter of pool rows with the state hash of the moved bytes, on the CPU.
    Pools are (layers, pool rows, k) contiguous views (packed_state.row_view); a part is the
    rows of every layer back to back, layer by layer, as `index_select(1, idx)` lays them out."""

    def __init__(self, hasher: DeviceHasher):
        if hasher.device.type != "cpu":
            raise NativeUnavailable("the fused row moves run on the CPU only")
        self.hasher = hasher
        self._gather = function("state_rows", "hyrax_gather_hash", _ARGS)
        self._scatter = function("state_rows", "hyrax_scatter_hash", _ARGS)

    def _call(self, fn, pool: torch.Tensor, idx: torch.Tensor, data_ptr: int, what: str) -> int:
        if pool.device.type != "cpu" or not pool.is_contiguous() or pool.dim() != 3:
            raise ValueError(f"{what}: the pool must be a contiguous (layers, rows, k) CPU tensor")
        idx = idx.contiguous()
        if idx.dtype != torch.int64 or idx.dim() != 1 or idx.device.type != "cpu":
            raise ValueError(f"{what}: the rows must be a (n,) int64 CPU tensor")
        layers, pool_rows, _ = pool.shape
        row_bytes = pool.shape[2] * pool.element_size()
        n = idx.shape[0]
        hash_rows = -(-layers * n * row_bytes // HASH_ROW_BYTES)
        v = self.hasher.row_weight_prefix(max(hash_rows, 1))
        out = ctypes.c_uint64()  # per call: a rank's moves may come from more than one thread
        rc = fn(pool.data_ptr(), layers, pool_rows, row_bytes, idx.data_ptr(), n, data_ptr,
                self.hasher.word_weights.data_ptr(), v.data_ptr(), ctypes.byref(out))
        raise_for(rc, what, _ERRORS)
        return out.value

    def gather(self, pool: torch.Tensor, idx: torch.Tensor, out_ptr: int) -> int:
        """Rows `idx` of every layer of `pool` written to the bytes at `out_ptr` (layers * n
        rows, nothing past them); returns their hash before the length term
        (`state_hash.with_length` completes it)."""
        return self._call(self._gather, pool, idx, out_ptr, "gather_hash")

    def scatter(self, pool: torch.Tensor, idx: torch.Tensor, rows: torch.Tensor) -> int:
        """`rows`, contiguous, laid out as `gather` writes them (layers * n pool rows, layer by
        layer; any dtype), written into rows `idx` of every layer; returns the hash of what those
        rows hold afterwards, before the length term."""
        want = pool.shape[0] * idx.shape[0] * pool.shape[2] * pool.element_size()
        if rows.device.type != "cpu" or not rows.is_contiguous() or rows.numel() * rows.element_size() != want:
            raise ValueError(f"scatter_hash: rows {tuple(rows.shape)} {rows.dtype} do not fit the pool "
                             f"{tuple(pool.shape)} {pool.dtype} at {idx.shape[0]} rows")
        return self._call(self._scatter, pool, idx, rows.data_ptr(), "scatter_hash")



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
