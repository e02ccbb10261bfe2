"""The CPU decode kernel (kernels/paged_decode.c) against dense attention over the same keys,
its refusals, its build (native.py), and the `cpu_paged` backend inside an engine."""
from __future__ import annotations

import copy
import math

import pytest
import torch

from engine_helpers import make_engine, run_requests, tiny_model
from hyrax.actors.engine.request import SamplingParams
from hyrax.actors.model import attn_backends, native
from hyrax.actors.model.attn_backends import CpuPaged, SdpaPaged, select_backend
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.paged_decode import available, paged_decode

needs_kernel = pytest.mark.skipif(available() is not None, reason=f"the kernel does not build here: {available()}")


def dense(q, pool, table, first, n_keys, qpos, page_size, window, scale):
    """Float64 attention of each sequence's query over its visible keys, looked up one by one."""
    B, H, D = q.shape
    G = pool.shape[2]
    out = torch.zeros(B, H, D, dtype=torch.float64)
    for b in range(B):
        hi = min(int(first[b] + n_keys[b] - 1), int(qpos[b]))
        lo = int(first[b]) if window is None else max(int(first[b]), int(qpos[b]) - window + 1)
        rows = [int(table[b, p // page_size]) * page_size + p % page_size for p in range(lo, hi + 1)]
        if not rows:
            continue
        kv = pool[rows].double()  # (n, 2, G, D)
        for h in range(H):
            g = h // (H // G)
            w = torch.softmax(kv[:, 0, g] @ q[b, h].double() * scale, dim=0)
            out[b, h] = w @ kv[:, 1, g]
    return out


def case(seed, B=5, H=4, G=2, D=32, page_size=4, window=None, longest=37):
    """A pool of NaN rows where only each sequence's visible keys hold numbers, shuffled
    pages shared out among the sequences, pages before a window released (-1)."""
    g = torch.Generator().manual_seed(seed)
    cols = -(-longest // page_size)
    pages = B * cols + 3  # some nobody holds
    pool = torch.full((pages * page_size, 2, G, D), float("nan"))
    perm = torch.randperm(pages, generator=g).tolist()
    table = torch.full((B, cols), -1, dtype=torch.int64)
    first, n_keys, qpos = (torch.zeros(B, dtype=torch.int64) for _ in range(3))
    for b in range(B):
        n = int(torch.randint(1, longest + 1, (1,), generator=g))
        qpos[b] = n - 1
        lo = 0 if window is None else max(0, n - window)
        first[b] = (lo // page_size) * page_size if window is not None else 0
        n_keys[b] = n - first[b]
        for c in range(first[b] // page_size, -(-n // page_size)):
            table[b, c] = perm.pop()
        for p in range(lo, n):
            row = table[b, p // page_size] * page_size + p % page_size
            pool[row] = torch.randn(2, G, D, generator=g)
    q = torch.randn(B, H, D, generator=g)
    return q, pool, table, first, n_keys, qpos


@needs_kernel
@pytest.mark.parametrize("H,G,D", [(4, 2, 32), (4, 4, 8), (8, 1, 20), (2, 1, 64)])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("window", [None, 1, 5])
def test_the_kernel_equals_dense_attention_over_the_visible_keys(H, G, D, page_size, window):
    q, pool, table, first, n_keys, qpos = case(H * D + page_size, H=H, G=G, D=D, page_size=page_size, window=window)
    scale = 1 / math.sqrt(D)
    got = paged_decode(q, pool, table, first, n_keys, qpos, page_size, window, scale)
    assert torch.isfinite(got).all()  # NaN everywhere a sequence must not look
    want = dense(q, pool, table, first, n_keys, qpos, page_size, window, scale)
    torch.testing.assert_close(got.double(), want, atol=2e-6, rtol=2e-6)


@needs_kernel
def test_each_sequence_is_computed_alone_whatever_shares_the_step():
    q, pool, table, first, n_keys, qpos = case(7, B=6)
    together = paged_decode(q, pool, table, first, n_keys, qpos, 4, None, 0.3)
    for b in range(6):
        alone = paged_decode(q[b:b + 1], pool, table[b:b + 1], first[b:b + 1], n_keys[b:b + 1], qpos[b:b + 1], 4,
                             None, 0.3)
        assert torch.equal(alone[0], together[b])  # bit for bit


@needs_kernel
def test_a_sequence_without_keys_gets_zeros_and_the_others_are_untouched():
    q, pool, table, first, n_keys, qpos = case(8, B=3)
    n_keys[1] = 0
    got = paged_decode(q, pool, table, first, n_keys, qpos, 4, None, 0.3)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got.double(), dense(q, pool, table, first, n_keys, qpos, 4, None, 0.3), atol=2e-6,
                               rtol=2e-6)


@needs_kernel
def test_a_visible_key_on_a_page_not_held_or_past_the_pool_is_an_error_not_a_read():
    q, pool, table, first, n_keys, qpos = case(9, B=2)
    held = table.clone()
    table[1, 0] = -1
    with pytest.raises(RuntimeError, match="page the request does not hold"):
        paged_decode(q, pool, table, first, n_keys, qpos, 4, None, 0.3)
    held[0, 0] = pool.shape[0] // 4  # the first page past the pool
    with pytest.raises(RuntimeError, match="past the pool"):
        paged_decode(q, pool, held, first, n_keys, qpos, 4, None, 0.3)


@needs_kernel
def test_arguments_the_kernel_cannot_take_are_refused_before_it_runs():
    q, pool, table, first, n_keys, qpos = case(10, B=2)
    call = lambda **kw: paged_decode(**{**dict(q=q, pool=pool, table=table, first=first, n_keys=n_keys,  # noqa: E731
                                                 qpos=qpos, page_size=4, window=None, scale=0.3), **kw})
    with pytest.raises(ValueError, match="float32"):
        call(q=q.double())
    with pytest.raises(ValueError, match="int64"):
        call(table=table.int())
    with pytest.raises(ValueError, match="contiguous"):
        call(pool=torch.cat([pool, pool], dim=3)[..., :pool.shape[3]])
    with pytest.raises(ValueError, match="does not fit"):
        call(q=q[:, :3].contiguous())
    with pytest.raises(ValueError, match=r"\(B,\)"):
        call(n_keys=n_keys[:1])
    with pytest.raises(ValueError, match="window"):
        call(window=0)


def test_no_compiler_means_a_reason_not_a_crash(monkeypatch, tmp_path):
    monkeypatch.setenv("HYRAX_KERNEL_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    native.load.cache_clear()
    try:
        with pytest.raises(native.NativeUnavailable, match="does not run"):
            native.load("paged_decode")
        assert "does not run" in available()
    finally:
        native.load.cache_clear()


def test_a_failing_build_says_what_the_compiler_said(monkeypatch, tmp_path):
    cc = tmp_path / "cc"
    cc.write_text("#!/bin/sh\n[ \"$1\" = --version ] && echo fake-cc 1.0 && exit 0\necho 'fatal: no luck' >&2\nexit 1\n")
    cc.chmod(0o755)
    monkeypatch.setenv("HYRAX_KERNEL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("CC", str(cc))
    native.load.cache_clear()
    try:
        with pytest.raises(native.NativeUnavailable, match="no luck"):
            native.load("paged_decode")
        assert list((tmp_path / "cache").iterdir()) == []  # no half-written library left behind
    finally:
        native.load.cache_clear()


@needs_kernel
def test_a_build_is_kept_and_reused_until_a_header_it_includes_changes(monkeypatch, tmp_path):
    """Another process on the same machine loads the library built before; the cache key
    covers the headers a source includes, not only the source itself."""
    import shutil

    sources, cache = tmp_path / "kernels", tmp_path / "cache"
    shutil.copytree(native.SOURCES, sources)
    monkeypatch.setattr(native, "SOURCES", sources)
    monkeypatch.setenv("HYRAX_KERNEL_CACHE", str(cache))
    builds = []
    real = native._build
    monkeypatch.setattr(native, "_build", lambda *a: (builds.append(a), real(*a)))
    native.load.cache_clear()
    try:
        native.load("ssd_scan")
        native.load.cache_clear()  # another process: same machine, same cache
        native.load("ssd_scan")
        assert len(builds) == 1 and len(list(cache.glob("ssd_scan-*.so"))) == 1
        with open(sources / "rows.h", "a") as f:
            f.write("/* changed */\n")
        native.load.cache_clear()
        native.load("ssd_scan")
    finally:
        native.load.cache_clear()
    assert len(builds) == 2 and len(list(cache.glob("ssd_scan-*.so"))) == 2


@needs_kernel
def test_a_new_build_deletes_the_same_kernel_s_builds_unused_for_a_month(monkeypatch, tmp_path):
    """Libraries of older sources (or compilers, or CPUs) do not pile up in the cache: a new
    build deletes the same kernel's libraries that no process has loaded for PRUNE_AFTER_S;
    loading a library marks it used, so one in use elsewhere (a shared cache) is kept."""
    import os
    import time

    monkeypatch.setenv("HYRAX_KERNEL_CACHE", str(tmp_path))
    tmp_path.chmod(0o700)
    month = native.PRUNE_AFTER_S
    planted = {n: tmp_path / n for n in ("ssd_scan-old.so", "ssd_scan-recent.so", "paged_decode-old.so")}
    for f in planted.values():
        f.write_bytes(b"")
    for n, age in (("ssd_scan-old.so", month + 3600), ("ssd_scan-recent.so", month - 3600),
                   ("paged_decode-old.so", month + 3600)):
        t = time.time() - age
        os.utime(planted[n], (t, t))
    native.load.cache_clear()
    try:
        native.load("ssd_scan")  # built now
        assert not planted["ssd_scan-old.so"].exists()
        assert planted["ssd_scan-recent.so"].exists() and planted["paged_decode-old.so"].exists()
        (built,) = [f for f in tmp_path.glob("ssd_scan-*.so") if f not in planted.values()]
        t = time.time() - month - 3600
        os.utime(built, (t, t))
        native.load.cache_clear()  # another process loads it: marked used again
        native.load("ssd_scan")
        assert built.stat().st_mtime > time.time() - 60
    finally:
        native.load.cache_clear()


def test_auto_picks_the_cpu_kernel_for_float32_on_the_cpu_and_says_why_not_otherwise():
    notes = []
    pick = lambda dt, native=lambda: None, dev="cpu", req="auto": select_backend(  # noqa: E731
        req, dev, dt, 32, note=notes.append, native=native)
    assert isinstance(pick(torch.float32), CpuPaged)
    assert isinstance(pick(torch.float64), SdpaPaged) and notes == []  # no kernel for it: nothing to say
    assert isinstance(pick(torch.bfloat16), SdpaPaged) and notes == []
    assert isinstance(pick(torch.float32, native=lambda: "no C compiler"), SdpaPaged)
    assert notes == ["note: decode attention uses SDPA: no C compiler"]
    assert isinstance(pick(torch.float32, req="sdpa"), SdpaPaged)
    assert isinstance(pick(torch.float32, req="cpu_paged"), CpuPaged)
    with pytest.raises(HyraxInputError, match="no C compiler"):
        pick(torch.float32, native=lambda: "no C compiler", req="cpu_paged")
    with pytest.raises(HyraxInputError, match="float32"):
        pick(torch.float64, req="cpu_paged")
    with pytest.raises(HyraxInputError, match="on the CPU"):
        pick(torch.float32, dev="cuda", req="cpu_paged")


@needs_kernel
@pytest.mark.parametrize("layout", ["full", "swa_mamba", "full_swa_mamba"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["per-request", "batched"])
def test_an_engine_on_the_cpu_kernel_decodes_what_sdpa_decodes(layout, deterministic, monkeypatch):
    """Chunked prefill, mixed steps, batched decode of unequal contexts, released SWA pages,
    forced retraction and restores into new pages: the same greedy tokens through the kernel as
    through SDPA, and the kernel did run the decode steps (float32 weights, which it needs)."""
    calls = []
    real = attn_backends.paged_decode
    monkeypatch.setattr(attn_backends, "paged_decode", lambda q, *a: (calls.append(q.shape[0]), real(q, *a))[1])
    outs = {}
    for backend in (SdpaPaged, CpuPaged):
        model = copy.deepcopy(tiny_model(layout, torch.float32))
        for b in range(len(model.model.layers)):
            if hasattr(model.model.layers[b], "self_attn"):
                model.model.layers[b].self_attn.backend = backend()
        engine = make_engine(model, deterministic=deterministic, forced_retraction_interval=3)
        prompts = [[(5 * i + j) % 90 + 1 for j in range(n)] for i, n in enumerate((3, 21, 40, 9, 33, 17))]
        outs[backend.name] = run_requests(engine, prompts, SamplingParams(max_tokens=12, ignore_eos=True))
        assert engine.stats.retractions, "forced retraction did not happen"
    assert calls and (max(calls) > 1) == (not deterministic)  # the kernel ran the decode steps (batched ones too)
    assert outs["cpu_paged"] == outs["sdpa"]


@needs_kernel
def test_a_cache_others_can_write_to_is_never_loaded_from(monkeypatch, tmp_path):
    """A directory another user could have planted a library in (group- or world-writable) is
    neither read nor built into: the build goes to the next place, this user's own."""
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("HYRAX_KERNEL_CACHE", str(shared))
    monkeypatch.setattr(native, "_fallback_dir", lambda: tmp_path / "own")
    native.load.cache_clear()
    try:
        native.load("paged_decode")
        planted = next((tmp_path / "own").glob("paged_decode-*.so")).name
        (shared / planted).write_bytes(b"not a library")
        native.load.cache_clear()
        native.load("paged_decode")  # loads the own copy, not the planted file
    finally:
        native.load.cache_clear()
    assert [p.name for p in shared.iterdir()] == [planted]
