"""Attention over paged K/V pools equals dense causal (windowed) attention — with the SDPA
backend, and with the vllm_flash_attn adapter driving a reference of that kernel's documented
semantics (tests/unit/flash_reference.py; the real kernel runs in tests/gpu)."""
from __future__ import annotations

import pytest
import torch

from flash_reference import varlen_paged_reference
from hyrax.actors.model.attention import dense_reference
from hyrax.actors.model.attn_backends import FlashPaged
from hyrax.actors.model.batch import SeqSlice, build_forward_batch
from tiny_models import PAGE_SIZE, fresh_pools, random_model, shuffled_pages, tiny_config

T = 19  # tokens per sequence; window is 5, pages hold 4 tokens
TOL = 1e-12


BACKENDS = ["sdpa", "flash_adapter"]


@pytest.fixture(params=BACKENDS)
def backend(request) -> str:
    return request.param


def attention_layer(layout: str, backend: str = "sdpa"):
    """The first layer's attention module of a float64 attention-only model, and the model."""
    model = random_model(tiny_config(layout))
    attn = model.model.layers[0].self_attn
    assert attn.backend.name == "sdpa"  # CPU: `auto` picks SDPA
    if backend == "flash_adapter":
        attn.backend = FlashPaged(varlen_paged_reference)
    return attn, model


def dense(attn, model, x: torch.Tensor) -> torch.Tensor:
    """x: (T, hidden) -> (T, hidden), attention over the whole sequence without any cache."""
    n, hd = x.shape[0], attn.head_dim
    cos, sin = model.rope.cos_sin(torch.arange(n)[None])
    q = model.rope.apply(attn.q_proj(x).view(1, n, -1, hd), cos, sin)[0]
    k = model.rope.apply(attn.k_proj(x).view(1, n, -1, hd), cos, sin)[0]
    v = attn.v_proj(x).view(n, -1, hd)
    return attn.o_proj(dense_reference(q, k, v, attn.window, attn.scale).reshape(n, -1))


def paged(attn, model, pools, xs: list[torch.Tensor], seqs: list[SeqSlice]) -> torch.Tensor:
    """One step over a packed batch; xs[b]: (len_b, hidden) -> (B, T, hidden)."""
    batch = build_forward_batch(seqs, model.components, PAGE_SIZE)
    x = torch.zeros(len(seqs), batch.max_len, xs[0].shape[-1], dtype=xs[0].dtype)
    for b, xb in enumerate(xs):
        x[b, : len(xb)] = xb
    return attn(x, batch, pools, model.rope, model.rope.cos_sin(batch.positions))


def run_chunks(attn, model, x, chunks, pages, before_step=None):
    """Feed x (T, hidden) in chunks through one sequence's page table; returns (T, hidden)."""
    pools = fresh_pools(model)
    name = attn.component
    out, pos = [], 0
    for n in chunks:
        if before_step is not None:
            before_step(pools[name][attn.local_layer], pages, pos)
        s = SeqSlice([0] * n, pos, {name: pages}, {})
        out.append(paged(attn, model, pools, [x[pos : pos + n]], [s])[0, :n])
        pos += n
    return torch.cat(out)


def row(pages: list[int], pos: int) -> int:
    return pages[pos // PAGE_SIZE] * PAGE_SIZE + pos % PAGE_SIZE


@pytest.mark.parametrize("layout", ["full", "swa"])
@pytest.mark.parametrize(
    "chunks",
    [[T], [6, 5, 1, 7], [8] + [1] * (T - 8), [1] * T],
    ids=["one_chunk", "chunked_prefill", "prefill_then_decode", "decode_only"],
)
def test_paged_attention_over_shuffled_pages_matches_dense_reference(layout, chunks, backend):
    attn, model = attention_layer(layout, backend)
    x = torch.randn(T, model.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    pages = shuffled_pages(model, -(-T // PAGE_SIZE), seed=3)[attn.component]
    assert pages != sorted(pages)  # the table really is out of order
    got = run_chunks(attn, model, x, chunks, pages)
    torch.testing.assert_close(got, dense(attn, model, x), atol=TOL, rtol=0)


def poison_outside_window(value: float, window: int, margin: int = 0):
    """A before-step hook: overwrite the rows of every position that left the window (plus
    `margin` positions still inside it, for the mutation check) and release the pages that
    lie wholly outside it, as the engine would."""

    def hook(pool: torch.Tensor, pages: list[int], start: int) -> None:
        oldest_visible = start - window + 1  # a query at `start` sees keys >= this
        for p in range(max(0, oldest_visible + margin)):
            if pages[p // PAGE_SIZE] >= 0:  # released pages were poisoned before release
                pool[row(pages, p)] = value
        for i in range(len(pages)):
            if (i + 1) * PAGE_SIZE <= oldest_visible:
                pages[i] = -1  # the step must not need this page at all

    return hook


@pytest.mark.parametrize("value", [float("nan"), 1e30], ids=["nan", "huge"])
def test_swa_never_reads_rows_older_than_its_window(value, backend):
    if backend == "flash_adapter" and value != value:
        pytest.skip("a flash kernel tile straddling the window start reads (and masks) older rows; "
                    "pool rows are always finite, so they weigh exactly 0 — NaN is not a state they can hold")
    attn, model = attention_layer("swa", backend)
    assert attn.window == 5
    x = torch.randn(T, model.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    pages = shuffled_pages(model, -(-T // PAGE_SIZE), seed=4)[attn.component]
    got = run_chunks(attn, model, x, [7, 3] + [1] * (T - 10), pages, poison_outside_window(value, attn.window))
    assert pages[0] == -1  # pages did get released along the way
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, dense(attn, model, x), atol=TOL, rtol=0)


def test_swa_poison_inside_the_window_is_noticed(backend):
    """Mutation check for the test above: poisoning one row that is still visible must show."""
    attn, model = attention_layer("swa", backend)
    x = torch.randn(T, model.cfg.hidden_size, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    pages = shuffled_pages(model, -(-T // PAGE_SIZE), seed=4)[attn.component]
    got = run_chunks(attn, model, x, [7, 3] + [1] * (T - 10), pages, poison_outside_window(float("nan"), attn.window, margin=1))
    assert torch.isnan(got[7:]).all(dim=-1).any()


@pytest.mark.parametrize("layout", ["full", "swa"])
def test_packed_prefill_and_decode_sequences_sharing_a_pool_match_their_own_references(layout, backend):
    attn, model = attention_layer(layout, backend)
    g = torch.Generator().manual_seed(5)
    lens = [14, 10, 17]
    xs = [torch.randn(n, model.cfg.hidden_size, dtype=torch.float64, generator=g) for n in lens]
    perm = torch.randperm(32, generator=g).tolist()  # interleave the sequences' pages
    tables = [perm[0:5], perm[5:10], perm[10:15]]
    pools = fresh_pools(model)
    name = attn.component
    # step 1: all three prefill different lengths; then each step mixes a prefill chunk of
    # sequence 2 with decode tokens of sequences 0 and 1
    pos = [0, 0, 0]
    outs = [[], [], []]
    for take in ([8, 6, 2], [1, 1, 5], [1, 1, 4], [1, 1, 6], [3, 1, 0]):
        seqs, xin, who = [], [], []
        for b, n in enumerate(take):
            if n:
                seqs.append(SeqSlice([0] * n, pos[b], {name: tables[b]}, {}))
                xin.append(xs[b][pos[b] : pos[b] + n])
                who.append((b, n))
        out = paged(attn, model, pools, xin, seqs)
        for i, (b, n) in enumerate(who):
            outs[b].append(out[i, :n])
            pos[b] += n
    assert pos == lens
    for b in range(3):
        torch.testing.assert_close(torch.cat(outs[b]), dense(attn, model, xs[b]), atol=TOL, rtol=0)


def test_padding_keys_never_read_rows_owned_by_other_requests(backend):
    attn, model = attention_layer("full", backend)
    pools = fresh_pools(model)
    pools[attn.component][:, 0] = float("nan")  # row 0 = page 0, owned by neither sequence
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(n, model.cfg.hidden_size, dtype=torch.float64, generator=g) for n in (9, 2)]
    seqs = [SeqSlice([0] * 9, 0, {attn.component: [5, 7, 9]}, {}),
            SeqSlice([0] * 2, 0, {attn.component: [3]}, {})]
    out = paged(attn, model, pools, xs, seqs)
    assert torch.isfinite(out[1, :2]).all()


@pytest.mark.parametrize("layout", ["full", "swa"])
def test_a_decode_batch_of_unequal_contexts_with_poisoned_padding_rows_matches_dense_reference(layout, backend):
    """One token per sequence (the decode path) for three sequences of different lengths in
    one batch: the shorter ones' padding keys point at row 0, which holds NaN here (page 0
    is nobody's), and must not leak; each output equals dense attention at its position."""
    attn, model = attention_layer(layout, backend)
    pools = fresh_pools(model)
    name = attn.component
    pools[name][:, 0] = float("nan")
    g = torch.Generator().manual_seed(8)
    lens = [9, 3, 14]
    xs = [torch.randn(n, model.cfg.hidden_size, dtype=torch.float64, generator=g) for n in lens]
    tables = [[5, 7, 9, 11], [3], [2, 4, 6, 8]]
    prefill = [SeqSlice([0] * (n - 1), 0, {name: t}, {}) for n, t in zip(lens, tables)]
    paged(attn, model, pools, [x[:-1] for x in xs], prefill)
    decode = [SeqSlice([0], n - 1, {name: t}, {}) for n, t in zip(lens, tables)]
    out = paged(attn, model, pools, [x[-1:] for x in xs], decode)
    assert out.shape[1] == 1
    for b, x in enumerate(xs):
        torch.testing.assert_close(out[b, 0], dense(attn, model, x)[-1], atol=TOL, rtol=0)


def test_the_cpu_route_of_the_step_metadata_equals_the_packed_route(monkeypatch):
    """On a CPU device the step's arrays become tensors without packing them (batch.PACK_ON_CPU);
    every field equals the packed, one-copy route's in dtype, shape and values."""
    import numpy as np

    import hyrax.actors.model.batch as batch_module

    rng = np.random.default_rng(3)
    host = {"ids": rng.integers(0, 99, (3, 5)), "flat": rng.integers(-1, 9, 7),
            "mask": rng.random((3, 5)) < 0.5, "none": np.zeros(0, dtype=np.int64),
            "strided": rng.integers(0, 9, (4, 6))[:, ::2]}
    cpu = batch_module.to_device(host, "cpu")
    monkeypatch.setattr(batch_module, "PACK_ON_CPU", True)
    packed = batch_module.to_device(host, "cpu")
    assert cpu.keys() == packed.keys() == host.keys()
    for name in host:
        assert cpu[name].dtype == packed[name].dtype and cpu[name].shape == packed[name].shape, name
        assert torch.equal(cpu[name], packed[name]), name


def test_a_cpu_step_of_several_slices_attends_one_sequence_at_a_time(monkeypatch):
    """On the CPU, SDPA runs a step of several slices per sequence (no query or key padded to
    the longest; the test above checks its values against dense attention); the padded batch
    is left to single sequences, decode steps and devices whose lengths the host cannot read."""
    from hyrax.actors.model.attn_backends import SdpaPaged

    attn, model = attention_layer("swa")
    padded = []
    inner = SdpaPaged._padded
    monkeypatch.setattr(SdpaPaged, "_padded", lambda self, q, *a: (padded.append(tuple(q.shape[:2])),
                                                                    inner(self, q, *a))[1])
    g = torch.Generator().manual_seed(6)
    lens = [9, 4, 12]
    xs = [torch.randn(n, model.cfg.hidden_size, dtype=torch.float64, generator=g) for n in lens]
    pages = shuffled_pages(model, 12, seed=7)[attn.component]
    seqs = [SeqSlice([0] * n, 0, {attn.component: pages[4 * b:4 * b + 4]}, {}) for b, n in enumerate(lens)]
    got = paged(attn, model, fresh_pools(model), xs, seqs)
    assert padded == []
    for b, x in enumerate(xs):
        torch.testing.assert_close(got[b, :len(x)], dense(attn, model, x), atol=TOL, rtol=0)
    paged(attn, model, fresh_pools(model), xs[:1], seqs[:1])  # one sequence: the padded batch is itself
    assert padded == [(1, 9)]
