"""What a per-request state component is: `ComponentSpec` and its kinds. Layer modules declare
their components with these (attention.py, mamba2.py, gated_deltanet.py); `state.py` derives a
model's component table from those declarations.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

TOKEN, WINDOW, SLOT = "token", "window", "slot"
KINDS = (TOKEN, WINDOW, SLOT)


@dataclass(frozen=True)
class ComponentSpec:
    """One kind of per-request state, as held by one TP rank.

    kind: `token` (one row per token, paged), `window` (rows for the last `window - 1`
    tokens only, paged, pages leaving the window are released), `slot` (one fixed-size
    row per request).
    """

    name: str
    kind: str
    layers: tuple[int, ...]
    unit_shape: tuple[int, ...]
    dtype: torch.dtype
    shard_dim: int
    shard_index: tuple[int, ...]  # global indices along shard_dim held by this rank
    global_size: int  # unsharded size of shard_dim
    window: int | None = None
    # slot kinds: the layers can write the state as of any token inside a step into a checkpoint
    # slot (batch.Capture), so a prefix-cache checkpoint need not end a prefill chunk
    captures_mid_step: bool = False

    @property
    def paged(self) -> bool:
        return self.kind in (TOKEN, WINDOW)

    @property
    def row_bytes(self) -> int:
        """Bytes of one row (one token, or one request's slot) over all layers of this rank."""
        return len(self.layers) * math.prod(self.unit_shape) * _itemsize(self.dtype)

    def live_rows(self, num_tokens: int) -> int:
        """Rows of state a request with `num_tokens` committed tokens holds (the byte formula)."""
        if self.kind == TOKEN:
            return num_tokens
        if self.kind == WINDOW:
            return min(num_tokens, self.window - 1)
        return 1

    def live_positions(self, num_tokens: int) -> range:
        """Token positions whose rows are live (paged kinds only)."""
        return range(num_tokens - self.live_rows(num_tokens), num_tokens)

    def global_unit_shape(self) -> tuple[int, ...]:
        s = list(self.unit_shape)
        s[self.shard_dim] = self.global_size
        return tuple(s)


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def ssm_dtype(model_dtype: torch.dtype) -> torch.dtype:
    """Recurrent state is kept in float32, or float64 when the model runs in float64."""
    return torch.float64 if model_dtype == torch.float64 else torch.float32


def recurrent_pair(conv_name: str, state_name: str, layers: tuple[int, ...], dtype: torch.dtype,
                   conv_channels: list[int], kernel: int, conv_dim: int, heads, head_unit: tuple[int, int],
                   n_heads: int, captures_mid_step: bool = False) -> list[ComponentSpec]:
    """A conv-state component ((channels, kernel - 1), sharded on channels) and a recurrent-state
    component ((heads, *head_unit), float32/64, sharded on heads), as Mamba2 and Gated DeltaNet keep."""
    return [
        ComponentSpec(name=conv_name, kind=SLOT, layers=layers, unit_shape=(len(conv_channels), kernel - 1),
                      dtype=dtype, shard_dim=0, shard_index=tuple(conv_channels), global_size=conv_dim,
                      captures_mid_step=captures_mid_step),
        ComponentSpec(name=state_name, kind=SLOT, layers=layers, unit_shape=(len(heads), *head_unit),
                      dtype=ssm_dtype(dtype), shard_dim=0, shard_index=tuple(heads), global_size=n_heads,
                      captures_mid_step=captures_mid_step),
    ]


def captures_mid_step(components) -> bool:
    """Whether every slot component's layers capture state inside a step (true with none)."""
    return all(c.captures_mid_step for c in components if c.kind == SLOT)
