"""Manifests: what a backup or transfer of one request holds, per component and per rank.

A manifest that lacks a component the model declares is an error, never a silent skip.

Checksums are `state_hash` values (hyrax/actors/engine/state_hash.py): a 64-bit position-mixed
hash of a component shard's bytes, computed with torch operations on the device that holds the
bytes. Every check in the state paths uses it, on whichever side the bytes are:

- backup: the saving rank hashes the gathered rows on its device; restore hashes the rows it
  wrote, on its device, and compares. On a GPU the rows never come back to the host to be checked.
- prefix-cache checkpoints: hashed on the device when written and again before a hit uses them.
- transfer (PD hand-off, migration; objects that crossed the network): the exporting rank hashes
  its shard on its device before it leaves; the importing rank hashes the bytes as they arrived
  (host memory, so on the CPU: the same definition gives the same value there) and again the rows
  it wrote, on its device. No zlib CRC32 is used: a host-side check has the same function on CPU,
  so one definition covers both ends of every move.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch

from hyrax.actors.engine.state_hash import state_hash
from hyrax.actors.model.state import ComponentSpec

checksum = state_hash  # the one checksum of state bytes (state_hash.py), under its manifest name


class ManifestError(RuntimeError):
    pass


@dataclass
class ComponentRecord:
    name: str
    indices: list[int]  # device indices (pages or slot) at the time of backup
    rows: int
    bytes: int  # per rank
    checksums: dict[int, int] = field(default_factory=dict)  # rank -> state_hash of its shard (64 bits)


@dataclass
class Manifest:
    req_id: str
    num_tokens: int  # the snapshot point: committed tokens the state covers
    mode: str
    num_ranks: int = 1  # TP ranks that produced it
    components: dict[str, ComponentRecord] = field(default_factory=dict)

    def require_complete(self, components: tuple[ComponentSpec, ...]) -> None:
        """Every declared component present, with a checksum from every producing rank."""
        ranks = self.num_ranks
        for c in components:
            rec = self.components.get(c.name)
            if rec is None:
                raise ManifestError(f"{self.req_id}: manifest lacks component {c.name}")
            missing = [r for r in range(ranks) if r not in rec.checksums]
            if missing:
                raise ManifestError(f"{self.req_id}: {c.name} has no checksum from rank(s) {missing}")

    def by_rank(self) -> dict[int, dict[str, int]]:
        """{rank: {component: checksum}}."""
        out: dict[int, dict[str, int]] = {}
        for name, rec in self.components.items():
            for r, crc in rec.checksums.items():
                out.setdefault(r, {})[name] = crc
        return out

    def to_dict(self) -> dict:
        return {
            "num_tokens": self.num_tokens, "mode": self.mode, "num_ranks": self.num_ranks,
            "components": {
                n: {"indices": r.indices, "rows": r.rows, "bytes": r.bytes,
                    "checksums": {str(k): f"{v:016x}" for k, v in r.checksums.items()}}
                for n, r in self.components.items()
            },
        }


# ---- what one rank exports: its rows of every component in one byte buffer ---------------------

PART_ALIGN = 64  # each part starts on a 64-byte boundary: its int64 words are aligned views
# Views of a received shard are only read, but torch warns about every view of read-only numpy
# memory (the object store's); a `warnings.catch_warnings` around each view cost ~0.3 ms.
warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)


@dataclass(frozen=True)
class ShardPart:
    """Where one component lies in a `StateShard`'s buffer."""

    offset: int  # bytes from the buffer's start
    shape: tuple[int, ...]  # (layers, rows, *unit)
    dtype: str  # a torch dtype's name ("bfloat16")
    shard_index: tuple[int, ...]  # global indices this rank holds along the component's sharded dim

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * getattr(torch, self.dtype).itemsize


@dataclass(frozen=True)
class StateShard:
    """One rank's exported state (PD hand-off, migration): every component's rows back to back
    in one contiguous uint8 buffer, and a small typed header. A numpy buffer is what Ray's object
    store serialises out of band and hands to the reader without a copy (a read-only view of
    shared memory): nothing of the state is pickled."""

    buffer: np.ndarray  # (nbytes,) uint8
    parts: dict[str, ShardPart]

    @staticmethod
    def layout(parts: dict[str, tuple[tuple[int, ...], torch.dtype, tuple[int, ...]]]) -> tuple[dict[str, ShardPart], int]:
        """component -> (shape, dtype, shard_index) -> (the parts at aligned offsets, buffer bytes)."""
        out, end = {}, 0
        for name, (shape, dtype, index) in parts.items():
            start = -(-end // PART_ALIGN) * PART_ALIGN
            out[name] = ShardPart(start, tuple(shape), str(dtype).removeprefix("torch."), tuple(index))
            end = start + out[name].nbytes
        return out, end

    def tensor(self, name: str) -> torch.Tensor:
        """The component's rows (layers, rows, *unit): a view of the buffer, not a copy. The
        buffer Ray hands over is read-only: the view must only be read."""
        p = self.parts[name]
        raw = torch.from_numpy(self.buffer[p.offset:p.offset + p.nbytes])
        return raw.view(getattr(torch, p.dtype)).view(p.shape)
