"""Environment variables Hyrax reads — all of them, typed, in one place."""
from __future__ import annotations

import os


def _int(name: str, default: int, least: int) -> int:
    """A HyraxInputError (the CLI's one-line error) for a value that is no int >= `least`."""
    from hyrax.actors.model.errors import HyraxInputError

    v = os.environ.get(name)
    try:
        n = int(v) if v else default
    except ValueError:
        raise HyraxInputError(f"{name} must be an integer, got {v!r}") from None
    if n < least:
        raise HyraxInputError(f"{name} must be >= {least}, got {n}")
    return n


def torch_threads() -> int:
    """HYRAX_TORCH_THREADS: intra-op threads per process/rank, >= 1. Default 1: small CPU models
    run fastest single-threaded, and several ranks share the machine's cores. `hyrax serve`
    checks it before anything starts (its ranks read it)."""
    return _int("HYRAX_TORCH_THREADS", 1, least=1)


def admin_token() -> str | None:
    """HYRAX_ADMIN_TOKEN: bearer token for /admin/*; generated at start when unset."""
    return os.environ.get("HYRAX_ADMIN_TOKEN") or None


def api_key() -> str | None:
    """HYRAX_API_KEY: the API key /v1/* requires (as vLLM's VLLM_API_KEY), read by `hyrax serve`
    in place of --api-key, so the key is not on its command line; None when unset, '' when set
    empty (an error there, not an open API)."""
    return os.environ.get("HYRAX_API_KEY")


def apply_torch_threads() -> None:
    import torch

    torch.set_num_threads(torch_threads())


def hf_hub_cache() -> "Path":
    """The local Hugging Face hub cache that `--model org/name` is looked up in: HF_HUB_CACHE,
    else $HF_HOME/hub, else $XDG_CACHE_HOME/huggingface/hub, else ~/.cache/huggingface/hub
    (the layout and precedence huggingface_hub uses). Hyrax only reads it, never downloads."""
    from pathlib import Path

    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg).expanduser() / "huggingface" / "hub"
