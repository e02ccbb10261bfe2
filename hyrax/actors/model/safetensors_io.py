"""Read one TP rank's slice of a `.safetensors` file with positional reads, straight into the
parameter it fills.

Format: an 8-byte little-endian header length n, n bytes of JSON
({name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}), then the
data; offsets count from the end of the header, tensors are row-major, little-endian.

Why not `safe_open`: it maps the whole file, and every page a slice touches stays resident
(counted in the process's RSS) until the file is closed, on top of the copies a slice makes.
Reading with `preadv` into the destination keeps a rank's peak memory at about its own shard
(plus one tensor's slice when the checkpoint's dtype differs from the model's), and it makes
"what this rank read" a number (`bytes_read`).
"""
from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

from hyrax.actors.model.errors import HyraxInputError

DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class Entry:
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # absolute file offset of the first byte

    @property
    def itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()


def runs(idx: list[int]) -> list[tuple[int, int]]:
    """Contiguous [start, stop) runs of an index list, in its order."""
    out: list[tuple[int, int]] = []
    for i in idx:
        if out and out[-1][1] == i:
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


class SafetensorsFile:
    """One open checkpoint file. `read_into(name, out, dim, index)` fills `out` with the tensor,
    or with the entries `index` (global indices, in order) along `dim`."""

    def __init__(self, path: str | Path):
        self.path = str(path)
        self.fd = os.open(self.path, os.O_RDONLY)
        self.bytes_read = 0
        try:
            self.entries = self._parse_header()
        except Exception:
            os.close(self.fd)
            raise

    def _parse_header(self) -> dict[str, Entry]:
        size = os.fstat(self.fd).st_size
        head = os.pread(self.fd, 8, 0)
        n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < n <= size - 8:
            raise HyraxInputError(f"{self.path} is not a safetensors file (bad header length)")
        try:
            meta = json.loads(os.pread(self.fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise HyraxInputError(f"{self.path} is not a safetensors file (header is not JSON)") from None
        entries = {}
        for name, e in meta.items():
            if name == "__metadata__":
                continue
            if e.get("dtype") not in DTYPES:
                raise HyraxInputError(f"{self.path}: tensor {name!r} has dtype {e.get('dtype')!r}, which Hyrax "
                                      f"does not load (quantized checkpoints are not supported)")
            entry = Entry(DTYPES[e["dtype"]], tuple(int(s) for s in e["shape"]), 8 + n + int(e["data_offsets"][0]))
            end = 8 + n + int(e["data_offsets"][1])
            if end > size or end - entry.offset != math.prod(entry.shape) * entry.itemsize:
                raise HyraxInputError(f"{self.path}: tensor {name!r} has data offsets that do not fit its shape")
            entries[name] = entry
        return entries

    def keys(self) -> list[str]:
        return list(self.entries)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.entries[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self.entries[name].dtype

    def read(self, name: str, dim: int | None = None, index: list[int] | None = None) -> torch.Tensor:
        """The tensor (or its slice) as a new CPU tensor of the checkpoint's dtype."""
        e = self.entries[name]
        shape = list(e.shape)
        if dim is not None:
            shape[dim] = len(index)
        out = torch.empty(shape, dtype=e.dtype)
        self.read_into(name, out, dim, index)
        return out

    def read_into(self, name: str, out: torch.Tensor, dim: int | None = None, index: list[int] | None = None) -> None:
        """Fill `out` (CPU, contiguous, the checkpoint's dtype and the slice's shape)."""
        e = self.entries[name]
        assert out.dtype == e.dtype and out.is_contiguous() and out.device.type == "cpu"
        if dim is None:
            dim, index = 0, list(range(e.shape[0])) if e.shape else []
        want = list(e.shape)
        if e.shape:
            want[dim] = len(index)
        assert list(out.shape) == want, (name, tuple(out.shape), want)
        dst = out.reshape(-1).view(torch.uint8).numpy()
        if not e.shape:  # a scalar
            self._pread(dst, e.offset)
            return
        outer = math.prod(e.shape[:dim])
        inner = math.prod(e.shape[dim + 1:]) * e.itemsize  # bytes of one entry along dim
        dst = dst.reshape(outer, len(index) * inner)
        pos = 0
        for a, b in runs(index):
            width = (b - a) * inner
            for o in range(outer):  # dim 0: one read per run; dim 1: one per row
                self._pread(dst[o, pos:pos + width], e.offset + (o * e.shape[dim] + a) * inner)
            pos += width

    def _pread(self, buf, offset: int) -> None:
        view = memoryview(buf).cast("B")
        done = 0
        while done < len(view):
            got = os.preadv(self.fd, [view[done:]], offset + done)
            if got <= 0:
                raise HyraxInputError(f"{self.path}: unexpected end of file")
            done += got
        self.bytes_read += done

    def close(self) -> None:
        os.close(self.fd)

    def __enter__(self) -> "SafetensorsFile":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
