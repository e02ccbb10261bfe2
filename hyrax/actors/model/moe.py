"""Mixture-of-experts feed-forward: a router picks `top_k` experts per token; the routed
experts' outputs, weighted, plus the shared expert's output form the layer's output.

Tensor parallelism: every expert (and the shared expert) is split along its intermediate
dimension, exactly like a dense MLP; the router is replicated. Each rank computes its
partial output for every token and expert it routes to, and one all-reduce per layer sums
the ranks (experts and shared expert together). Routing is computed identically on every
rank from the same replicated input, so ranks agree on the experts without communicating.
This keeps every expert's load balanced across ranks and needs no all-to-all; its limit is
that `moe_intermediate_size` (and the shared size) must divide by tp_size.

The expert loop below is the reference path (tokens gathered per expert, `index_add_`);
there is no fused kernel yet. It reads the chosen experts on the host and gathers a number
of tokens per expert that depends on the routing, which a CUDA graph capture forbids. The
static dispatch (`MoE.static_dispatch`, switched on by `CaptureSafe` around the forward a
graph captures, cuda_graphs.py) runs every expert over every token instead and weights its
output by the token's routing weight for that expert, 0 where it was not chosen: fixed
shapes, no host reads, E / top_k times the expert work. Unchosen experts add exactly 0, and
experts are added in the same order as the loop's, so the outputs differ from the loop's by
at most the products' summation order (an expert's GEMM over all rows, not its tokens').
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch
from torch import nn

from hyrax.actors.model import sharding
from hyrax.actors.model.config import ModelConfig, MoeConfig
from hyrax.actors.model.mlp import FusedGatedMLP, GatedMLP, ReluSqMLP
from hyrax.actors.model.norm import AllReduce
from hyrax.actors.model.sharding import TP


class Router(nn.Module):
    def __init__(self, moe: MoeConfig, hidden: int, dtype: torch.dtype):
        super().__init__()
        self.moe = moe
        self.weight = nn.Parameter(torch.zeros(moe.num_experts, hidden, dtype=dtype), requires_grad=False)
        if moe.router == "sigmoid_grouped":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: (N, hidden) -> weights (N, top_k) in x's dtype, expert ids (N, top_k)."""
        m = self.moe
        if m.router == "topk_softmax":
            logits = nn.functional.linear(x, self.weight).float()
            top, idx = logits.topk(m.top_k, dim=-1)
            return torch.softmax(top, dim=-1).to(x.dtype), idx
        if m.router == "softmax_topk":
            probs = torch.softmax(nn.functional.linear(x, self.weight), dim=-1, dtype=torch.float)
            top, idx = probs.topk(m.top_k, dim=-1)
            if m.norm_topk_prob:
                top = top / top.sum(dim=-1, keepdim=True)
            return top.to(x.dtype), idx
        f = torch.float64 if x.dtype == torch.float64 else torch.float32
        scores = nn.functional.linear(x.to(f), self.weight.to(f)).sigmoid()  # (N, E)
        choice = scores + self.e_score_correction_bias.to(f)
        per_group = m.num_experts // m.n_group
        grouped = choice.view(-1, m.n_group, per_group)
        group_scores = grouped.topk(min(2, per_group), dim=-1)[0].sum(dim=-1)  # (N, n_group)
        keep = torch.zeros_like(group_scores).scatter_(1, group_scores.topk(m.topk_group, dim=-1)[1], 1.0)
        keep = keep[:, :, None].expand(-1, -1, per_group).reshape(-1, m.num_experts).bool()
        idx = choice.masked_fill(~keep, float("-inf")).topk(m.top_k, dim=-1)[1]
        w = scores.gather(1, idx)
        if m.norm_topk_prob:
            w = w / (w.sum(dim=-1, keepdim=True) + 1e-20)
        return (w * m.routed_scaling_factor).to(x.dtype), idx


class StackedExperts(nn.Module):
    """Granite's experts: `input_linear` (E, 2 * I, hidden) = [gate | up], `output_linear` (E, hidden, I)."""

    def __init__(self, moe: MoeConfig, hidden: int, tp: TP, dtype: torch.dtype):
        super().__init__()
        n = moe.intermediate_size
        self.cols = list(sharding.columns(n, tp, "moe intermediate_size"))
        self.rows = self.cols + [n + c for c in self.cols]
        e = moe.num_experts
        self.input_linear = nn.Parameter(torch.zeros(e, len(self.rows), hidden, dtype=dtype), requires_grad=False)
        self.output_linear = nn.Parameter(torch.zeros(e, hidden, len(self.cols), dtype=dtype), requires_grad=False)

    def shard_rules(self) -> dict[str, tuple[int, list[int]] | None]:
        return {"input_linear": (1, self.rows), "output_linear": (2, self.cols)}

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        gate, up = nn.functional.linear(x, self.input_linear[e]).chunk(2, dim=-1)
        return nn.functional.linear(nn.functional.silu(gate) * up, self.output_linear[e])


class ExpertList(nn.ModuleList):
    """One MLP module per expert (`experts.{e}.up_proj` ...), as NemotronH and Qwen save them."""

    def __init__(self, moe: MoeConfig, hidden: int, tp: TP, dtype: torch.dtype):
        cls = GatedMLP if moe.gated_experts else ReluSqMLP
        super().__init__(cls(hidden, moe.intermediate_size, tp, dtype) for _ in range(moe.num_experts))

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        return self[e](x)


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TP, dtype: torch.dtype, allreduce: AllReduce,
                 stacked_experts: bool = False, fused_shared: bool = False):
        super().__init__()
        m, h = cfg.moe, cfg.hidden_size
        self.moe = m
        if m.num_experts:
            self.router = Router(m, h, dtype)
            self.experts = (StackedExperts if stacked_experts else ExpertList)(m, h, tp, dtype)
        if m.shared_intermediate_size:
            shared = FusedGatedMLP if fused_shared else GatedMLP if m.gated_experts else ReluSqMLP
            bias = {"bias": True} if m.shared_expert_bias else {}  # FusedGatedMLP (Granite) has none
            self.shared_expert = shared(h, m.shared_intermediate_size, tp, dtype, **bias)
            if m.shared_expert_gate:
                self.shared_expert_gate = nn.Linear(h, 1, bias=False, dtype=dtype)
        self.allreduce = allreduce
        self.static_dispatch = False  # True only inside a `CaptureSafe` call (module docstring)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: (B, T, hidden) -> (B, T, hidden), summed over TP ranks."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        out = torch.zeros_like(flat)
        if self.moe.num_experts:
            weights, idx = self.router(flat)  # (N, k) each
            if self.static_dispatch:
                self._dispatch_all(flat, weights, idx, out)
            else:
                for e in idx.unique().tolist():
                    tok, slot = torch.where(idx == e)
                    y = self.experts.expert(e, flat[tok]) * weights[tok, slot, None]
                    out.index_add_(0, tok, y.to(out.dtype))
        if self.moe.shared_intermediate_size:
            s = self.shared_expert(flat)
            if self.moe.shared_expert_gate:
                s = torch.sigmoid(self.shared_expert_gate(flat)) * s
            out = out + s
        return self.allreduce(out.view(shape))

    def _dispatch_all(self, flat: torch.Tensor, weights: torch.Tensor, idx: torch.Tensor, out: torch.Tensor) -> None:
        """The static dispatch into `out` (N, hidden): every expert over all N tokens, in expert
        order, each token's output weighted by its routing weight for the expert. Where a token
        did not choose the expert its output is replaced by 0 (not multiplied by 0: an unchosen
        expert's inf would make NaN), so it adds exactly nothing, as in the loop."""
        n, experts = idx.shape[0], self.moe.num_experts
        dense = weights.new_zeros(n, experts).scatter_(1, idx, weights)  # (N, E); a token's k experts differ
        chosen = torch.zeros(n, experts, dtype=torch.bool, device=idx.device).scatter_(1, idx, True)
        for e in range(experts):
            y = self.experts.expert(e, flat) * dense[:, e, None]
            out.add_(torch.where(chosen[:, e, None], y, 0).to(out.dtype))


def moe_layers(model: nn.Module) -> list[MoE]:
    """The model's MoE modules that route to experts (a shared expert alone needs no dispatch)."""
    return [m for m in model.modules() if isinstance(m, MoE) and m.moe.num_experts]


@contextmanager
def static_dispatch(layers: list[MoE]) -> Iterator[None]:
    """`layers` run the static dispatch inside the block, the loop again after it."""
    for m in layers:
        m.static_dispatch = True
    try:
        yield
    finally:
        for m in layers:
            m.static_dispatch = False


class CaptureSafe:
    """`forward` with the model's MoE layers in static dispatch for the call's duration: the
    forward a CUDA graph warms up and captures (cuda_graphs.CudaGraphDecode). The model's own
    forward, which runs prefill and the batches above the largest graph, keeps the loop, so a
    prompt never pays for every expert."""

    def __init__(self, model: nn.Module, forward: Callable[..., torch.Tensor]):
        self.forward, self.layers = forward, moe_layers(model)

    def __call__(self, *args, **kwargs) -> torch.Tensor:
        with static_dispatch(self.layers):
            return self.forward(*args, **kwargs)
