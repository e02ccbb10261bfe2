"""Causal depthwise convolution with per-request state, shared by Mamba2 and Gated DeltaNet.

A request's slot holds the last `kernel - 1` conv inputs. One step prepends them to the
step's inputs, convolves, and keeps the last `kernel - 1` inputs of each (right-padded)
sequence as its new state.
"""
from __future__ import annotations

import torch
from torch import nn


def causal_conv_step(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, q_lens: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (B, T, C) this step's inputs; pool: (slots, C, K-1) one layer's conv state, updated
    in place for `slots` (B,); q_lens: (B,) valid tokens per sequence; weight: (C, 1, K).
    Returns silu(conv(x)): (B, T, C)."""
    B, T, C = x.shape
    keep = weight.shape[-1] - 1
    state = pool.index_select(0, slots).to(x.dtype)  # (B, C, K-1); index_select: advanced indexing is slower
    seq = torch.cat([state, x.transpose(1, 2)], dim=2)  # (B, C, K-1+T)
    if T == 1:  # every sequence has its one token (a batch never holds an empty slice)
        # one token per sequence: the convolution is a dot product over the kernel's taps
        # (a grouped conv1d call costs ~50x more at this size on CPU), and the new state is the
        # window shifted by that token
        out = (seq * weight[:, 0]).sum(-1)
        if bias is not None:
            out = out + bias
        pool.index_copy_(0, slots, seq[:, :, 1:].to(pool.dtype))
        return nn.functional.silu(out)[:, None]
    out = nn.functional.conv1d(seq, weight, bias, groups=C)
    take = q_lens[:, None] + torch.arange(keep, device=x.device)[None, :]  # (B, K-1)
    pool.index_copy_(0, slots, seq.gather(2, take[:, None, :].expand(B, C, keep)).to(pool.dtype))
    return nn.functional.silu(out).transpose(1, 2)
