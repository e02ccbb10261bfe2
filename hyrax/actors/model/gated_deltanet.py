"""Gated DeltaNet (Qwen3-Next linear attention) — placeholder until implemented."""
from __future__ import annotations

from torch import nn

from hyrax.actors.model.errors import HyraxInputError


class GatedDeltaNet(nn.Module):
    def __init__(self, *args, **kwargs):
        super().__init__()
        raise HyraxInputError("gated_deltanet layers are not implemented yet")
