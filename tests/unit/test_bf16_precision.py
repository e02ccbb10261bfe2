"""A bf16 model keeps what is precision-critical in float32: Mamba2's per-head A_log, dt_bias
and D, the step sizes softplus(dt + dt_bias) and the logits. Each is compared with a float32
model holding the same (float32) weights."""
from __future__ import annotations

import math

import pytest
import torch

from hyrax.actors.model.batch import SeqSlice
from hyrax.actors.model.hybrid import HybridModel
from hyrax.actors.model.ssd import ssd_chunked
from tiny_models import fresh_pools, randomize_, slots_for, step, tiny_config

CFG = dict(hidden_size=32, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=8, mamba_chunk_size=16)


def mamba2_init_(model: HybridModel, seed: int = 0) -> HybridModel:
    """Random weights, with Mamba2's own ranges for the SSM parameters: A ~ U(1, 16) and
    dt_bias = softplus^-1(dt), dt ~ logU(1e-3, 1e-1) (so dt + dt_bias sits near -2..-7)."""
    randomize_(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                p.copy_(torch.log(1 + 15 * torch.rand(p.shape, generator=g)))
            elif leaf == "dt_bias":
                lo, hi = math.log(1e-3), math.log(1e-1)
                dt = torch.exp(lo + (hi - lo) * torch.rand(p.shape, generator=g))
                p.copy_(dt + torch.log(-torch.expm1(-dt)))
            elif leaf == "D":
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def pair(**cfg) -> tuple[HybridModel, HybridModel]:
    """(float32 reference, bf16 model loaded from the reference's weights)."""
    ref = mamba2_init_(HybridModel(tiny_config("mamba", **{**CFG, **cfg}), dtype=torch.float32))
    low = HybridModel(ref.cfg, dtype=torch.bfloat16)
    low.load_state_dict(ref.state_dict())
    return ref, low


def rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    return ((a.double() - ref.double()).norm() / ref.double().norm()).item()


def test_bf16_mamba_discretizes_in_float32():
    """Given the same dt from in_proj, a bf16 mixer's step sizes, A and the state they drive
    through 256 tokens match float32's (they were 0.4-1.5 % off per head, compounding)."""
    ref, low = pair()
    mr, ml = ref.model.layers[0].mamba, low.model.layers[0].mamba
    assert {p.dtype for p in (ml.A_log, ml.dt_bias, ml.D)} == {torch.float32}
    g = torch.Generator().manual_seed(3)
    T, H, P, N = 256, mr.nh, ref.cfg.mamba_d_head, ref.cfg.mamba_d_state
    dt_raw = torch.randn(1, T, H, generator=g).to(torch.bfloat16)  # what a bf16 in_proj yields
    dt_r, A_r = mr.discretize(dt_raw.float(), torch.float32)
    dt_l, A_l = ml.discretize(dt_raw, torch.float32)
    assert dt_l.dtype == torch.float32
    x, B, C = (torch.randn(1, T, H, P, generator=g), torch.randn(1, T, 2, N, generator=g),
               torch.randn(1, T, 2, N, generator=g))
    state0 = torch.zeros(1, H, P, N)
    _, s_r = ssd_chunked(x, dt_r, A_r, B, C, mr.D, 16, state0)
    _, s_l = ssd_chunked(x, dt_l, A_l, B, C, ml.D, 16, state0)
    errors = {"dt": rel(dt_l, dt_r), "A": rel(A_l, A_r), "state": rel(s_l, s_r)}
    assert max(errors.values()) < 1e-6, errors  # with bf16 parameters: dt 0.48 %, A 0.41 %, state 0.57 %


def _prompt_logits(model: HybridModel, tokens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    pools = fresh_pools(model, capacity_tokens=len(tokens) + 8)
    logits = step(model, pools, [SeqSlice(tokens, 0, {}, slots_for(model, 1))])[0]
    return logits, pools["mamba_ssm"][:, 1]


@pytest.mark.parametrize("tied", [False, True])
def test_bf16_logits_are_float32(tied):
    """The head runs in float32: a bf16 model's logits are not rounded to bf16's 8 significant
    bits, and equal float32 math on its own final hidden state."""
    ref, low = pair(tie_word_embeddings=tied)
    assert low.lm_head.weight.dtype == torch.float32
    assert (low.lm_head.weight is low.model.embed_tokens.weight) == tied
    tokens = torch.randint(0, ref.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.inference_mode():
        logits, _ = _prompt_logits(low, tokens)
        ref_logits, _ = _prompt_logits(ref, tokens)
    assert logits.dtype == torch.float32
    rounded = logits.to(torch.bfloat16).float()
    assert (rounded != logits).float().mean() > 0.9  # bf16 logits would all survive the round trip
    assert rel(logits, ref_logits) < 0.1  # the same model, up to bf16's activations
