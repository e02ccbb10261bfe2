"""Causal depthwise convolution with per-request state, shared by Mamba2 and Gated DeltaNet.

A request's slot holds the last `kernel - 1` conv inputs. One step prepends them to the
step's inputs, convolves, and keeps the last `kernel - 1` inputs of each (right-padded)
sequence as its new state.
"""
from __future__ import annotations

import torch
from torch import nn

from hyrax.actors.model.row_copy import index_copy_rows_


def causal_conv_step(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, q_lens: torch.Tensor,
                     weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x: (B, T, C) this step's inputs; pool: (slots, C, K-1) one layer's conv state, updated
    in place for `slots` (B,); q_lens: (B,) valid tokens per sequence; weight: (C, 1, K).
    Returns silu(conv(x)): (B, T, C) in x's dtype, contiguous; the taps are summed in float32
    (float64 for float64 inputs), as a conv kernel accumulates.

    The convolution is a sum over the kernel's K taps, each a multiply-add of a shifted
    (B, T, C) window by one weight per channel, in the inputs' own layout: on the CPU this
    beats a grouped conv1d at every length measured (C=320: T=1 26 vs 113 us, T=8 40 vs
    125 us, T=256 246 vs 337 us, T=2048 2.1 vs 6.8 ms; C=3328, B=16, T=1: 0.29 vs 1.2 ms).
    """
    B, T, C = x.shape
    if T == 1:  # every sequence has its one token (a batch never holds an empty slice)
        return _conv_one_token(x, pool, slots, weight, bias)
    K = weight.shape[-1]
    keep = K - 1
    f = torch.promote_types(x.dtype, torch.float32)  # the taps' accumulation dtype
    state = pool.index_select(0, slots)  # (B, C, K-1); index_select: advanced indexing is slower
    seq = torch.cat([state.transpose(1, 2).to(f), x.to(f)], dim=1)  # (B, K-1+T, C)
    # (K, C), each tap's row contiguous: a tap read with the weight's stride of K made every
    # multiply-add an unvectorised loop (one sequence of 256 tokens, C=320: 0.67 -> 0.35 ms a call,
    # with the in-place silu below; the same bits)
    taps = weight[:, 0].t().to(f).contiguous()
    out = torch.mul(seq[:, :T], taps[0])
    for k in range(1, K):
        out.addcmul_(seq[:, k:k + T], taps[k])
    take = q_lens[:, None] + torch.arange(keep, device=x.device)[None, :]  # (B, K-1)
    new_state = seq.gather(1, take[:, :, None].expand(B, keep, C))
    if bias is not None:
        out += bias.to(f)
    index_copy_rows_(pool, slots, new_state.transpose(1, 2).to(pool.dtype))
    return nn.functional.silu(out, inplace=True).to(x.dtype)


def _conv_one_token(x: torch.Tensor, pool: torch.Tensor, slots: torch.Tensor, weight: torch.Tensor,
                    bias: torch.Tensor | None) -> torch.Tensor:
    """`causal_conv_step` of one token per sequence (x: (B, 1, C)), read and written in the
    slots' own (C, K-1) layout: the taps are multiply-added in order (the state's K-1 columns,
    then the token, then the bias: the same operations, so the same bits, as the multi-token
    path), and the new state is the rows' flat contents moved one element left with the token
    in each channel's last place. No (B, K, C) window, product or transposed state is built
    (five fewer passes; B=16, C=1664, one thread, min of runs: 401 -> 283 us; C=384 256 -> 218).
    """
    B, _, C = x.shape
    keep = weight.shape[-1] - 1
    f = torch.promote_types(x.dtype, torch.float32)
    state = pool.index_select(0, slots)  # (B, C, K-1)
    window = state.to(f)
    taps = weight[:, 0].to(f)  # (C, K)
    token = x[:, 0]  # (B, C)
    out = torch.mul(window[:, :, 0], taps[:, 0])  # (B, C)
    for k in range(1, keep):
        out.addcmul_(window[:, :, k], taps[:, k])
    out.addcmul_(token.to(f), taps[:, keep])
    if bias is not None:
        out += bias.to(f)
    new_state = torch.empty_like(state)
    new_state.view(B, -1)[:, :-1] = state.view(B, -1)[:, 1:]  # column j + 1 -> j (the last: overwritten)
    new_state[:, :, keep - 1] = token
    index_copy_rows_(pool, slots, new_state)
    return nn.functional.silu(out).to(x.dtype)[:, None]


def conv_state_after(state: torch.Tensor, x: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Slots' conv states after the first `lens` tokens of a step: the last `kernel - 1` inputs
    up to there. state: (n, C, K-1) the slots before the step; x: (B, T, C) the step's inputs;
    rows: (n,) long, each point's batch row (one may repeat); lens: (n,) long, 0 < lens <= T.
    Only the K-1 inputs each point needs are read. Returns (n, C, K-1) in state's dtype."""
    keep, C = state.shape[-1], x.shape[2]
    pos = lens[:, None] - keep + torch.arange(keep, device=x.device)[None, :]  # (n, K-1); < 0: from the slot
    # x may be a strided view (a split of in_proj's output): indexed where it lies, not copied whole
    from_x = x[rows[:, None], pos.clamp(min=0)].transpose(1, 2).to(state.dtype)  # (n, C, K-1)
    from_slot = state.gather(2, (pos + keep).clamp(max=keep - 1)[:, None, :].expand(-1, C, -1))
    return torch.where((pos < 0)[:, None, :], from_slot, from_x)



def capture_conv_states(into: torch.Tensor, name: str, pool: torch.Tensor, slots: torch.Tensor, x: torch.Tensor,
                        cap) -> None:
    """Write each capture point's conv state (`conv_state_after`) into its row of `into`, one
    layer of component `name`'s checkpoint pool: `pool`/`slots` are the layer's conv slots before
    the step moves them on, x the step's conv inputs, `cap` the batch's Capture."""
    into.index_copy_(0, cap.slots[name], conv_state_after(pool.index_select(0, slots.index_select(0, cap.rows)),
                                                         x, cap.rows, cap.lens))
