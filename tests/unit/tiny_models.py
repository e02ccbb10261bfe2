"""Shared helpers for the model unit tests: tiny configs, random weights, paged runs.

Imported by the test modules next to it (pytest puts this folder on sys.path).
"""
from __future__ import annotations

import torch

from hyrax.actors.engine.pools import allocate_device_pools, pool_sizes
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from hyrax.actors.model.config import ModelConfig
from hyrax.actors.model.hybrid import HybridModel

LAYOUTS = {
    "full": ("full_attention", "full_attention"),
    "swa": ("sliding_attention", "sliding_attention"),
    "mamba": ("mamba2", "mamba2"),
    "swa_mamba": ("sliding_attention", "mamba2", "mamba2", "sliding_attention"),
    "full_swa_mamba": ("full_attention", "mamba2", "sliding_attention", "mamba2"),
}

PAGE_SIZE = 4


def tiny_config(layout: str, **overrides) -> ModelConfig:
    """A small config for one of LAYOUTS; SWA layouts get sliding_window=5."""
    types = LAYOUTS[layout]
    kw = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, layer_types=types,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_n_groups=2,
        mamba_d_conv=4, mamba_chunk_size=4,
        sliding_window=5 if "sliding_attention" in types else None,
    )
    kw.update(overrides)
    return ModelConfig(**kw)


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Fill every parameter with values large enough that mistakes show up.

    Weights ~ N(0, 0.3); norm weights ~ 1 + N(0, 0.3); A_log ~ U(-1, 1) (decays between
    exp(-e) and exp(-1/e) per unit dt); dt_bias ~ N(0, 0.5); D ~ N(0, 1).
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            parent = name.rsplit(".", 2)[-2] if name.count(".") else ""
            if leaf == "A_log":
                new = torch.rand(p.shape, generator=g, dtype=torch.float64) * 2 - 1
            elif leaf == "dt_bias":
                new = torch.randn(p.shape, generator=g, dtype=torch.float64) * 0.5
            elif leaf == "D":
                new = torch.randn(p.shape, generator=g, dtype=torch.float64)
            elif "norm" in parent:
                new = 1 + 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            else:
                new = 0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64)
            p.copy_(new.to(p.dtype))
    return module


def random_model(cfg: ModelConfig, dtype=torch.float64, seed: int = 0) -> HybridModel:
    return randomize_(HybridModel(cfg, dtype=dtype), seed)


def fresh_pools(model: HybridModel, capacity_tokens: int = 128, slots: int = 4) -> dict[str, torch.Tensor]:
    comps = model.components
    return allocate_device_pools(comps, pool_sizes(comps, PAGE_SIZE, capacity_tokens, slots))


def shuffled_pages(model: HybridModel, n_pages: int, seed: int, capacity_tokens: int = 128) -> dict[str, list[int]]:
    """A non-contiguous, shuffled page table per paged component (distinct pages per seed)."""
    g = torch.Generator().manual_seed(seed)
    total = capacity_tokens // PAGE_SIZE
    return {c.name: torch.randperm(total, generator=g)[:n_pages].tolist() for c in model.components if c.paged}


def slots_for(model: HybridModel, slot: int) -> dict[str, int]:
    return {c.name: slot for c in model.components if not c.paged}


def step(model: HybridModel, pools, seqs: list[SeqSlice]) -> torch.Tensor:
    """One forward step; returns logits (B, T, vocab) at every position."""
    batch = build_forward_batch(seqs, model.components, PAGE_SIZE)
    return model(batch, pools, all_logits=True)


def run_in_chunks(model: HybridModel, tokens: list[int], chunks: list[int], seed: int = 0, slot: int = 1) -> torch.Tensor:
    """Feed `tokens` to a fresh pool in chunks of the given sizes; returns logits (T, vocab)."""
    assert sum(chunks) == len(tokens)
    pools = fresh_pools(model)
    pages = shuffled_pages(model, -(-len(tokens) // PAGE_SIZE), seed)
    out, pos = [], 0
    for n in chunks:
        s = SeqSlice(tokens[pos : pos + n], pos, pages, slots_for(model, slot))
        out.append(step(model, pools, [s])[0, :n])
        pos += n
    return torch.cat(out)
