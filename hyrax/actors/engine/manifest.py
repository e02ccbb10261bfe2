"""Manifests: what a backup or transfer of one request holds, per component and per rank.

A manifest that lacks a component the model declares is an error, never a silent skip.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field

import torch

from hyrax.actors.model.state import ComponentSpec


class ManifestError(RuntimeError):
    pass


def checksum(t: torch.Tensor) -> int:
    """CRC32 of a tensor's bytes (any dtype; copied to host if needed)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return zlib.crc32(memoryview(t.contiguous().view(torch.uint8).numpy()) if t.numel() else b"")


@dataclass
class ComponentRecord:
    name: str
    indices: list[int]  # device indices (pages or slot) at the time of backup
    rows: int
    bytes: int  # per rank
    checksums: dict[int, int] = field(default_factory=dict)  # rank -> crc32


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
                    "checksums": {str(k): f"{v:08x}" for k, v in r.checksums.items()}}
                for n, r in self.components.items()
            },
        }
