"""A 64-bit hash of a tensor's bytes, computed with torch operations where the tensor lives.

Backups, restores, exports, imports and prefix-cache checkpoints verify state with it: on a
CUDA rank the rows are hashed on the GPU and only one int64 scalar per component comes back to
the host, never the rows themselves.

Definition (identical on every device; the value depends on the bytes and their order only):

- the tensor's bytes in row-major order (`t.contiguous()`), zero-padded to a whole number of
  rows of `ROW_WORDS` little-endian 64-bit words: `x[r, c]`, shape (R, ROW_WORDS);
- `h = sum_r v[r] * (sum_c w[c] * x[r, c])  +  nbytes * LENGTH_MIX   (mod 2**64)`,
  with `v` and `w` fixed pseudo-random **odd** 64-bit weights (splitmix64 of the position).

What it guarantees, and why:

- every single-bit flip changes `h`: flipping bit k of word (r, c) changes it by
  `± v[r] * w[c] * 2**k`, and a product of odd numbers times `2**k` (k < 64) is never 0 mod 2**64;
- position dependence: each word has its own weight `v[r] * w[c]`, so swapped rows, a row
  copied from another request, or a row written at the wrong place change `h` unless a linear
  relation over 64-bit weights happens to vanish (probability about 2**-62 for such errors);
- a shorter or longer tensor whose extra bytes are zeros hashes differently (`nbytes` term).

A missing component is caught one level up: a manifest without it, or a load result that
lacks it, fails verification (`Manifest.require_complete`, `StateMoves.verified`).

Speed: the inner sum is one matrix-vector product on the CPU (int64 `mv` runs at ~8 GB/s on
one core here, against ~3 GB/s for zlib.crc32 and the plain copy's ~11 GB/s); CUDA has no
integer `mv`, so there the same sum is an elementwise product reduced along rows (memory-bound
on a GPU). Which of the two runs is chosen once per device (`DeviceHasher`). Weights are cached
per device and grown by doubling, so a call allocates nothing large.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

ROW_WORDS = 256  # words per hash row (2 KiB): a partial last row is at most this long to pad
# Tensors up to this many words are hashed by one dot product with the per-word weights
# v[i // ROW_WORDS] * w[i % ROW_WORDS], kept expanded (64 KiB per device): the same value as the
# row-wise form in two torch calls instead of about ten (7-14 KB tensors: ~19 vs ~45 us, one
# core). Larger ones take the row-wise form, which reads no weights (0.1-4 MB: as fast or faster).
FLAT_MAX_WORDS = 1 << 13
MASK = (1 << 64) - 1
LENGTH_MIX = 0x9E3779B97F4A7C15  # odd: the byte count enters the hash bijectively
_ROW_STREAM = 1 << 40  # row weights are drawn from another stretch of the sequence than word weights


def odd_weights(start: int, n: int) -> np.ndarray:
    """splitmix64 of positions start .. start+n-1, with the low bit set: (n,) int64."""
    with np.errstate(over="ignore"):
        z = (np.arange(start, start + n, dtype=np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z | np.uint64(1)).view(np.int64)


def row_weights(n: int) -> np.ndarray:
    """The row weights v[0 .. n-1]: (n,) int64."""
    return odd_weights(_ROW_STREAM, n)


def _mv(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x: (R, C) int64, w: (C,) int64 -> (R,) row sums of x * w, wrapping mod 2**64."""
    return torch.mv(x, w)


def _mul_sum_rows(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The same as `_mv`, for devices without an integer matrix-vector product (CUDA)."""
    return (x * w).sum(1)


def _mul_sum(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x, w: (k,) int64 -> 0-dim sum of x * w, wrapping (CUDA has no integer `dot`)."""
    return (x * w).sum()


class DeviceHasher:
    """`state_hash` on one device, with its weights. Get one through `hasher(device)`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.word_weights = torch.from_numpy(odd_weights(0, ROW_WORDS)).to(device)  # (ROW_WORDS,)
        self.row_weights = torch.from_numpy(row_weights(64)).to(device)  # (>= R + 1,), grown on demand
        cpu = device.type == "cpu"
        self.row_sums: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = _mv if cpu else _mul_sum_rows
        self.dot: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = torch.dot if cpu else _mul_sum
        self.zero = torch.zeros((), dtype=torch.int64, device=device)
        self.flat_weights = self._expand(1)  # (>= words,) v[i // ROW_WORDS] * w[i % ROW_WORDS], grown on demand

    def _grow(self, rows: int) -> torch.Tensor:
        """The row weights, at least `rows` of them (grown by doubling). Callers use the tensor
        returned, never the attribute read again: one hasher serves every thread of a process
        (two in-process engines' loops, say), and another thread may store its own, shorter,
        weights between this one's store and a second read (a kernel would then read past them)."""
        v = self.row_weights
        if rows > len(v):
            v = torch.from_numpy(row_weights(1 << (rows - 1).bit_length())).to(self.device)
            self.row_weights = v
        return v

    def _expand(self, rows: int) -> torch.Tensor:
        """The per-word weights of the first `rows` hash rows: (rows * ROW_WORDS,) int64."""
        return (self._grow(rows)[:rows, None] * self.word_weights[None, :]).reshape(-1)

    def words(self, t: torch.Tensor) -> torch.Tensor:
        """t's bytes in row-major order as little-endian int64 words: (ceil(nbytes / 8),), a view
        of t where its layout allows; a copy for a non-contiguous t, a start not on an 8-byte
        boundary or a byte count that is not a multiple of 8 (zero-padded)."""
        b = t.detach().reshape(-1).view(torch.uint8)  # (nbytes,)
        n = b.numel()
        if n % 8 == 0 and b.data_ptr() % 8 == 0:
            return b.view(torch.int64)
        padded = torch.zeros(-(-n // 8) * 8, dtype=torch.uint8, device=b.device)
        padded[:n] = b
        return padded.view(torch.int64)

    def tensor(self, t: torch.Tensor) -> torch.Tensor:
        """The hash of t before the length term: a 0-dim int64 tensor on this device (no sync).
        x: t's words, (R, ROW_WORDS) whole rows plus k < ROW_WORDS words of a last row, whose
        missing words are zeros and so add nothing."""
        x = self.words(t)
        n = x.numel()
        if n <= FLAT_MAX_WORDS:
            flat = self.flat_weights  # read once, as `_grow` says
            if n > len(flat):
                flat = self.flat_weights = self._expand(-(-(1 << (n - 1).bit_length()) // ROW_WORDS))
            return self.dot(x, flat[:n])
        r, k = divmod(n, ROW_WORDS)
        w, v = self.word_weights, self._grow(r + 1)
        h = self.dot(self.row_sums(x[: r * ROW_WORDS].view(r, ROW_WORDS), w), v[:r]) if r else self.zero
        if k:
            h = h + self.dot(x[r * ROW_WORDS:], w[:k]) * v[r]
        return h

    def row_weight_prefix(self, n: int) -> torch.Tensor:
        """v[0 .. n-1] on this device: (n,) int64 (a view of the cached weights)."""
        return self._grow(n)[:n]

    def packed(self, words: torch.Tensor, part_weights: torch.Tensor) -> torch.Tensor:
        """Hashes, before their length terms, of the parts of a packed buffer (packed_state.py):
        words: (R, ROW_WORDS) int64, part_weights: (P, R) int64 -> (P,) int64 on this device
        (no sync): sum_r part_weights[p, r] * (sum_c w[c] * words[r, c])."""
        return self.row_sums(part_weights, self.row_sums(words, self.word_weights))

    def many(self, ts: Sequence[torch.Tensor]) -> list[int]:
        """state_hash of each tensor in `ts` (all on this device), with one read to the host."""
        if not ts:
            return []
        raw = torch.stack([self.tensor(t) for t in ts]).tolist()
        return [with_length(h, t.numel() * t.element_size()) for h, t in zip(raw, ts)]


def with_length(raw: int, nbytes: int) -> int:
    """The state hash of `nbytes` bytes from their sum before the length term (`raw`: the
    definition's double sum, as a signed or unsigned 64-bit value)."""
    return (raw + nbytes * LENGTH_MIX) & MASK


_hashers: dict[torch.device, DeviceHasher] = {}


def hasher(device: torch.device | str) -> DeviceHasher:
    """The hasher of `device` (made once per device and process)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    h = _hashers.get(device)
    if h is None:
        h = _hashers[device] = DeviceHasher(device)
    return h


def state_hash(t: torch.Tensor) -> int:
    """The 64-bit hash of t's bytes (see the module docstring), computed on t's device."""
    return hasher(t.device).many([t])[0]


def state_hashes(ts: Sequence[torch.Tensor]) -> list[int]:
    """state_hash of each tensor, with one host read per device the tensors are on."""
    out: list[int | None] = [None] * len(ts)
    by_device: dict[torch.device, list[int]] = {}
    for i, t in enumerate(ts):
        by_device.setdefault(t.device, []).append(i)
    for device, idx in by_device.items():
        for i, h in zip(idx, hasher(device).many([ts[i] for i in idx])):
            out[i] = h
    return out
