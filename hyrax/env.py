"""Environment variables Hyrax reads — all of them, typed, in one place."""
from __future__ import annotations

import os


def _int(name: str, default: int) -> int:
    v = os.environ.get(name)
    try:
        return int(v) if v else default
    except ValueError:
        raise SystemExit(f"hyrax: error: {name} must be an integer, got {v!r}") from None


def torch_threads() -> int:
    """HYRAX_TORCH_THREADS: intra-op threads per process/rank. Default 1: small CPU models run
    fastest single-threaded, and several ranks share the machine's cores."""
    return _int("HYRAX_TORCH_THREADS", 1)


def admin_token() -> str | None:
    """HYRAX_ADMIN_TOKEN: bearer token for /admin/*; generated at start when unset."""
    return os.environ.get("HYRAX_ADMIN_TOKEN") or None


def apply_torch_threads() -> None:
    import torch

    torch.set_num_threads(torch_threads())
