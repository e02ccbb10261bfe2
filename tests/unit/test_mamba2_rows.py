"""The C Mamba2 decode and prefill steps (kernels/mamba2_rows.c) against the layer's definition
computed in float64, token by token, and a model through them against the same model through
the torch path."""
from __future__ import annotations

import copy

import pytest
import torch
from engine_helpers import mixer_switch_outputs, tiny_model

from hyrax.actors.model.mamba2 import Mamba2Mixer
from hyrax.actors.model.mamba2_rows import (available, mamba2_decode_rows_, mamba2_packed_rows_, mamba2_prefill_rows_,
                                            mixer_weights)

pytestmark = pytest.mark.skipif(available() is not None, reason=f"the kernel does not build here: {available()}")


def _reference(zxbcdt, conv_pool, conv_rows, conv_w, conv_b, ssm_pool, ssm_rows, dt_bias, A_log, D, limits,
               norm_w, eps, group, mode):
    """The decode step from its definition, in float64; returns (out, new conv rows, new SSM rows)."""
    f = torch.float64
    B = zxbcdt.shape[0]
    _, H, P, N = ssm_pool.shape
    C, K = conv_w.shape[0], conv_w.shape[-1]
    inner = H * P
    G = (C - inner) // (2 * N)
    zx = zxbcdt[:, 0].to(f)
    z, xbc, dt = zx[:, :inner], zx[:, inner:inner + C], zx[:, inner + C:]
    window = torch.cat([conv_pool[conv_rows].to(f), xbc[:, :, None]], dim=2)  # (B, C, K)
    conv = sum(conv_w[None, :, 0, k].to(f) * window[:, :, k] for k in range(K))
    if conv_b is not None:
        conv = conv + conv_b.to(f)
    u = conv * torch.sigmoid(conv)
    x, Bm, Cm = u[:, :inner].view(B, H, P), u[:, inner:inner + G * N].view(B, G, N), u[:, inner + G * N:].view(B, G, N)
    step = torch.nn.functional.softplus(dt + dt_bias.to(f)).clamp(*limits)
    decay = torch.exp(step * -torch.exp(A_log.to(f)))
    heads = torch.arange(H) // (H // G)
    S = ssm_pool[ssm_rows].to(f) * decay[:, :, None, None] \
        + (step[:, :, None] * x)[..., None] * Bm[:, heads][:, :, None, :]
    y = (S * Cm[:, heads][:, :, None, :]).sum(-1) + D.to(f)[:, None] * x
    y = y.reshape(B, inner)
    gate = z * torch.sigmoid(z)
    if mode == "gate_only":
        out = y * gate
    else:
        h = y * gate if mode == "gate_then_norm" else y
        g = h.view(B, inner // group, group)
        h = (g / torch.sqrt(g.pow(2).mean(-1, keepdim=True) + eps)).view(B, inner) * norm_w.to(f)
        out = h if mode == "gate_then_norm" else h * gate
    return out[:, None], window[:, :, 1:], S


@pytest.mark.parametrize("mode", ["gate_then_norm", "norm_then_gate", "gate_only"])
@pytest.mark.parametrize("H,P,N,G,group", [(4, 8, 32, 1, 32), (6, 16, 20, 2, 48), (2, 64, 64, 1, 128)])
@pytest.mark.parametrize("with_bias,limits", [(True, (0.0, float("inf"))), (False, (0.01, 0.3))])
def test_the_kernel_equals_the_layer_computed_in_float64(mode, H, P, N, G, group, with_bias, limits):
    g = torch.Generator().manual_seed(H * 100 + N + G)
    B, K, slots = 5, 4, 9
    inner = H * P
    C = inner + 2 * G * N
    wide = torch.randn(B, 1, inner + C + H + 7, generator=g) * 1.5
    wide[0, 0, :6] = torch.tensor([-120.0, -60.0, 30.0, 95.0, -95.0, 0.0])  # silu far out on both sides
    zxbcdt = wide[:, :, 3:3 + inner + C + H]  # a slice of a wider row, as the model may hand it over
    conv_pool = torch.randn(slots, C, K - 1, generator=g)
    ssm_pool = torch.randn(slots, H, P, N, generator=g)
    conv_rows, ssm_rows = torch.tensor([7, 0, 3, 8, 5]), torch.tensor([2, 6, 0, 4, 8])
    conv_w = torch.randn(C, 1, K, generator=g) * 0.5
    conv_b = torch.randn(C, generator=g) if with_bias else None
    dt_bias, A_log, D = torch.randn(H, generator=g) - 2.0, torch.rand(H, generator=g) * 3 - 1, torch.randn(H, generator=g)
    A_log[0] = 6.0  # a decay that underflows for some rows
    norm_w = None if mode == "gate_only" else torch.randn(inner, generator=g)
    want = _reference(zxbcdt, conv_pool, conv_rows, conv_w, conv_b, ssm_pool, ssm_rows, dt_bias, A_log, D, limits,
                      norm_w, 1e-5, group, mode)
    conv_before, ssm_before = conv_pool.clone(), ssm_pool.clone()
    w = mixer_weights(conv_w, conv_b, dt_bias, A_log, D, limits, norm_w, 1e-5, group, mode)
    out = mamba2_decode_rows_(zxbcdt, conv_pool, conv_rows, ssm_pool, ssm_rows, w)
    torch.testing.assert_close(out.double(), want[0], rtol=2e-5, atol=2e-5)
    assert torch.equal(conv_pool[conv_rows], want[1].float())  # the window moves on: copies, bit for bit
    torch.testing.assert_close(ssm_pool[ssm_rows].double(), want[2], rtol=2e-5, atol=2e-5)
    others = [r for r in range(slots) if r not in conv_rows.tolist()]
    assert torch.equal(conv_pool[others], conv_before[others])
    others = [r for r in range(slots) if r not in ssm_rows.tolist()]
    assert torch.equal(ssm_pool[others], ssm_before[others])


@pytest.mark.parametrize("mode", ["gate_then_norm", "norm_then_gate", "gate_only"])
@pytest.mark.parametrize("H,P,N,G,group", [(4, 32, 32, 1, 128), (6, 16, 20, 2, 48), (2, 64, 64, 1, 128)])
def test_the_prefill_kernel_equals_the_layer_token_by_token(mode, H, P, N, G, group):
    """Sequences of different lengths in one right-padded step: each equals the float64
    definition applied token by token from its rows; padding gives zeros and moves no state."""
    g = torch.Generator().manual_seed(H * 7 + N + G)
    B, T, K, slots = 4, 9, 4, 7
    inner = H * P
    C = inner + 2 * G * N
    zxbcdt = (torch.randn(B, T, inner + C + H + 5, generator=g) * 1.5)[:, :, 2:2 + inner + C + H]
    q_lens = torch.tensor([9, 1, 4, 7])
    conv_pool, ssm_pool = torch.randn(slots, C, K - 1, generator=g), torch.randn(slots, H, P, N, generator=g)
    conv_rows, ssm_rows = torch.tensor([6, 2, 0, 4]), torch.tensor([1, 5, 3, 0])
    conv_w, conv_b = torch.randn(C, 1, K, generator=g) * 0.5, torch.randn(C, generator=g)
    dt_bias, A_log, D = torch.randn(H, generator=g) - 2.0, torch.rand(H, generator=g) * 3 - 1, torch.randn(H, generator=g)
    norm_w = None if mode == "gate_only" else torch.randn(inner, generator=g)
    params = (conv_w, conv_b, dt_bias, A_log, D, (0.001, 0.5), norm_w, 1e-5, group, mode)
    conv_want, ssm_want = conv_pool.double(), ssm_pool.double()
    want = torch.zeros(B, T, inner, dtype=torch.float64)
    for b in range(B):
        for t in range(int(q_lens[b])):
            one = zxbcdt[b:b + 1, t:t + 1]
            r = [conv_rows[b].item()], [ssm_rows[b].item()]
            y, conv_want[r[0]], ssm_want[r[1]] = _reference(one, conv_want, r[0], conv_w, conv_b, ssm_want, r[1],
                                                            dt_bias, A_log, D, *params[5:])
            want[b, t] = y[0, 0]
    w = mixer_weights(*params)
    out = mamba2_prefill_rows_(zxbcdt, conv_pool, conv_rows, ssm_pool, ssm_rows, q_lens, w)
    torch.testing.assert_close(out.double(), want, rtol=5e-5, atol=5e-5)
    torch.testing.assert_close(conv_pool.double(), conv_want, rtol=0, atol=0)  # inputs moved, bit for bit
    torch.testing.assert_close(ssm_pool.double(), ssm_want, rtol=5e-5, atol=5e-5)


def test_packed_tokens_give_the_padded_layout_s_results_bit_for_bit():
    """The same sequences as a padded (B, T) step and packed back to back: the same outputs at
    the real tokens and the same states, bit for bit (each sequence is computed alone)."""
    g = torch.Generator().manual_seed(11)
    H, P, N, K = 4, 32, 32, 4
    inner, C = H * P, H * P + 2 * N
    w = mixer_weights(torch.randn(C, 1, K, generator=g), torch.randn(C, generator=g), torch.randn(H, generator=g),
                      torch.randn(H, generator=g), torch.randn(H, generator=g), (0.0, float("inf")),
                      torch.randn(inner, generator=g), 1e-5, inner, "gate_then_norm")
    q_lens = torch.tensor([5, 2, 8])
    padded = torch.randn(3, 8, inner + C + H, generator=g)
    valid = torch.arange(8)[None, :] < q_lens[:, None]
    packed = padded[valid][None]
    rows = torch.tensor([2, 0, 1])
    pools = [(torch.randn(4, C, K - 1, generator=g), torch.randn(4, H, P, N, generator=g)) for _ in range(2)]
    pools[1] = (pools[0][0].clone(), pools[0][1].clone())
    a = mamba2_prefill_rows_(padded, pools[0][0], rows, pools[0][1], rows, q_lens, w)
    b = mamba2_packed_rows_(packed, pools[1][0], rows, pools[1][1], rows, q_lens.cumsum(0) - q_lens, q_lens, w)
    assert torch.equal(a[valid], b[0]) and not a[~valid].any()
    assert torch.equal(pools[0][0], pools[1][0]) and torch.equal(pools[0][1], pools[1][1])


def test_the_vectorised_silu_is_within_two_units_in_the_last_place():
    """The kernel's silu (its own branch-free exp) against float64, over the float range where
    silu is a normal float, and at the edges: large inputs give themselves, large negative ones
    a tiny negative number, NaN stays NaN."""
    import ctypes

    from hyrax.actors.model.native import function

    silu = function("mamba2_rows", "hyrax_silu_f32", [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64], None)
    x = torch.cat([torch.linspace(-80.0, 80.0, 400_001), torch.tensor([0.0, -0.0, 1e-30, -1e-30, 100.0, 1e30])])
    out = torch.empty_like(x)
    silu(x.data_ptr(), out.data_ptr(), x.numel())
    want = (x.double() * torch.sigmoid(x.double())).float()
    ulp = (torch.nextafter(want.abs(), torch.tensor(float("inf"))) - want.abs()).double()
    err = ((out.double() - want.double()).abs() / ulp)
    assert err.max() <= 2.0, (x[err.argmax()], out[err.argmax()], want[err.argmax()])
    edge = torch.tensor([-120.0, -1e30, float("nan")])
    got = torch.empty_like(edge)
    silu(edge.data_ptr(), got.data_ptr(), 3)
    assert -1e-35 < got[0] <= 0 and -1e-20 < got[1] <= 0 and got[2].isnan()


def test_a_sequence_gets_the_same_bits_whatever_shares_its_step():
    g = torch.Generator().manual_seed(5)
    H, P, N, K = 4, 16, 32, 4
    inner, C = H * P, H * P + 2 * N
    w = mixer_weights(torch.randn(C, 1, K, generator=g), None, torch.randn(H, generator=g), torch.randn(H, generator=g),
                       torch.randn(H, generator=g), (0.0, float("inf")), torch.randn(inner, generator=g), 1e-5, inner,
                       "gate_then_norm")
    zxbcdt = torch.randn(6, 1, inner + C + H, generator=g)
    conv_pool, ssm_pool = torch.randn(6, C, K - 1, generator=g), torch.randn(6, H, P, N, generator=g)
    alone_conv, alone_ssm = conv_pool.clone(), ssm_pool.clone()
    rows = torch.arange(6)
    together = mamba2_decode_rows_(zxbcdt, conv_pool, rows, ssm_pool, rows, w)
    alone = mamba2_decode_rows_(zxbcdt[2:3], alone_conv, rows[2:3], alone_ssm, rows[2:3], w)
    assert torch.equal(together[2:3], alone)
    assert torch.equal(ssm_pool[2], alone_ssm[2])


def test_refusals_leave_the_pools_untouched():
    H, P, N, K = 2, 8, 16, 4
    inner, C = H * P, H * P + 2 * N
    w = mixer_weights(torch.randn(C, 1, K), None, torch.randn(H), torch.randn(H), torch.randn(H),
                       (0.0, float("inf")), torch.randn(inner), 1e-5, inner, "gate_then_norm")
    zxbcdt = torch.randn(2, 1, inner + C + H)
    conv_pool, ssm_pool = torch.randn(3, C, K - 1), torch.randn(3, H, P, N)
    before = conv_pool.clone(), ssm_pool.clone()
    with pytest.raises(RuntimeError, match="outside the pool"):
        mamba2_decode_rows_(zxbcdt, conv_pool, torch.tensor([0, 1]), ssm_pool, torch.tensor([2, 3]), w)
    with pytest.raises(ValueError, match="share a state row"):
        mamba2_decode_rows_(zxbcdt, conv_pool, torch.tensor([1, 2]), ssm_pool, torch.tensor([1, 1]), w)
    with pytest.raises(ValueError, match="float32"):
        mamba2_decode_rows_(zxbcdt, conv_pool.double(), torch.tensor([0, 1]), ssm_pool, torch.tensor([0, 1]), w)
    with pytest.raises(ValueError, match="zxbcdt"):
        mamba2_decode_rows_(zxbcdt[:, :, 1:], conv_pool, torch.tensor([0, 1]), ssm_pool, torch.tensor([0, 1]), w)
    with pytest.raises(RuntimeError, match="outside the step's rows"):
        mamba2_packed_rows_(torch.randn(1, 3, inner + C + H), conv_pool, torch.tensor([0, 1]), ssm_pool,
                            torch.tensor([0, 1]), torch.tensor([0, 2]), torch.tensor([2, 2]), w)
    with pytest.raises(ValueError, match="unknown norm mode 'rms'"):
        mixer_weights(torch.randn(C, 1, K), None, torch.randn(H), torch.randn(H), torch.randn(H),
                      (0.0, float("inf")), torch.randn(inner), 1e-5, inner, "rms")
    assert torch.equal(conv_pool, before[0]) and torch.equal(ssm_pool, before[1])


@pytest.mark.parametrize("layout", ["mamba", "full_swa_mamba"])
def test_a_model_through_the_c_steps_decodes_what_the_torch_path_decodes(layout, monkeypatch):
    """Chunked prefill, mixed and decode steps, forced retraction: the same greedy tokens with
    the layer's steps in C as through the torch operations (the C step on packed slices, decode
    tokens among them), and the kernels did run, batched. (The C prefill step on one padded
    slice runs in test_models_checkpoints.py, against transformers.)"""
    import hyrax.actors.model.mamba2 as mamba2

    calls = {"decode": [], "packed": []}  # (sequences, their token counts) per call
    for kind in calls:
        real = getattr(mamba2, f"mamba2_{kind}_rows_")
        monkeypatch.setattr(mamba2, f"mamba2_{kind}_rows_",
                            lambda *a, _r=real, _k=kind: (calls[_k].append((a[2].shape[0], a[-2])), _r(*a))[1])
    outs = mixer_switch_outputs(layout, "native_step")
    assert max(b for b, _ in calls["decode"]) > 1  # batched decode steps
    assert any(b > 1 and int(n.min()) == 1 < int(n.max()) for b, n in calls["packed"])  # decode tokens beside chunks
    assert outs[0] == outs[1]


def test_a_changed_parameter_reaches_the_kernel():
    """The kernel's copy of a layer's parameters is remade when one of them changes in place."""
    mixer = next(m for m in copy.deepcopy(tiny_model("mamba")).modules() if isinstance(m, Mamba2Mixer))
    first = mixer.kernel_weights()
    assert mixer.kernel_weights() is first
    with torch.no_grad():
        mixer.D.add_(1.0)
    again = mixer.kernel_weights()
    assert again is not first and torch.equal(again.D, mixer.D.float())


def test_the_traced_operator_s_weights_are_not_taken_from_other_parameters_at_the_same_address():
    """The compiled decode's operator keeps the kernels' layout of each layer's parameters across
    steps, found by the parameters' addresses and versions. New parameters can sit where freed
    ones sat, with the same version (here: tensors over one reused buffer, its bytes rewritten
    outside torch, as an allocator hands freed memory to the next model loaded in a process):
    their values must be the ones the kernel reads, not the freed parameters' layout."""
    import gc

    from hyrax.actors.model import mamba2_rows

    H, C, K = 4, 12, 4
    sizes = [C * K, C, H, H, H, C]  # conv weight, conv bias, dt_bias, A_log, D, norm weight (bf16)
    buf = bytearray(2 * sum(sizes))

    def params(fill: float) -> tuple:
        values = torch.full((sum(sizes),), fill, dtype=torch.bfloat16)
        buf[:] = values.view(torch.uint8).numpy().tobytes()  # written outside torch: no version bump
        flat = torch.frombuffer(buf, dtype=torch.bfloat16)
        parts = list(flat.split(sizes))
        parts[0] = parts[0].view(C, 1, K)
        return tuple(parts)

    first = params(0.5)
    w1 = mamba2_rows._traced_weights(first, (0.0, float("inf")), 1e-5, C, "gate_then_norm")
    assert torch.equal(w1.D, torch.full((H,), 0.5))
    del first, w1
    gc.collect()
    second = params(0.25)
    w2 = mamba2_rows._traced_weights(second, (0.0, float("inf")), 1e-5, C, "gate_then_norm")
    assert torch.equal(w2.D, torch.full((H,), 0.25))
    assert torch.equal(w2.taps, torch.full_like(w2.taps, 0.25))
    assert mamba2_rows._traced_weights(second, (0.0, float("inf")), 1e-5, C, "gate_then_norm") is w2  # kept


def test_the_traced_operator_builds_each_layer_s_weights_once_in_a_deep_model(monkeypatch):
    """A compiled decode step calls the operator once per Mamba2 layer, in order: a model with
    more layers than the cache once held (64: Falcon-H1's deep checkpoints have 66 and 72) is
    served from it on every later step, not rebuilt layer by layer."""
    from hyrax.actors.model import mamba2_rows

    monkeypatch.setattr(mamba2_rows, "_TRACED_WEIGHTS", {})
    built = []
    real = mamba2_rows.mixer_weights
    monkeypatch.setattr(mamba2_rows, "mixer_weights", lambda *a: built.append(1) or real(*a))
    H, C, K = 4, 12, 4
    layers = [(torch.randn(C, 1, K), torch.randn(C), torch.randn(H), torch.randn(H), torch.randn(H), torch.randn(C))
              for _ in range(72)]
    for _ in range(3):  # three decode steps
        for params in layers:
            mamba2_rows._traced_weights(params, (0.0, float("inf")), 1e-5, C, "gate_then_norm")
    assert len(built) == 72
