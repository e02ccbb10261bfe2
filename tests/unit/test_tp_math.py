"""Tensor-parallel shards, run in lockstep with a summing all-reduce, reproduce the unsharded model."""
from __future__ import annotations

import threading

import pytest
import torch

from hyrax.actors.model.batch import SeqSlice
from hyrax.actors.model.hybrid import HybridModel
from hyrax.actors.model.loader import load_model, save_model
from hyrax.actors.model.norm import identity_allreduce
from hyrax.actors.model.sharding import TP
from tiny_models import fresh_pools, random_model, shuffled_pages, slots_for, step, tiny_config

TOL = 1e-9
# prefill 9 tokens, a second chunk of 5 (crosses SSD chunks and the window), then 3 decodes
CHUNKS = [9, 5, 1, 1, 1]


class LockstepAllReduce:
    """An in-process all-reduce for `n` ranks running in threads: every rank posts its
    tensor, waits for the others, and sums all of them in rank order (so every rank gets
    bit-identical results)."""

    def __init__(self, n: int):
        self.barrier = threading.Barrier(n, timeout=60)
        self.posted: list[torch.Tensor | None] = [None] * n

    def for_rank(self, rank: int):
        def allreduce(t: torch.Tensor) -> torch.Tensor:
            self.posted[rank] = t
            self.barrier.wait()
            total = self.posted[0].clone()
            for other in self.posted[1:]:
                total += other
            self.barrier.wait()  # nobody posts the next tensor before all have summed
            return total

        return allreduce


def run_steps(model, toks: list[int]) -> torch.Tensor:
    """Feed toks in CHUNKS through a fresh pool; returns logits (T, vocab)."""
    pools = fresh_pools(model)
    pages, slots = shuffled_pages(model, 5, seed=1), slots_for(model, 0)
    out, pos = [], 0
    for n in CHUNKS:
        out.append(step(model, pools, [SeqSlice(toks[pos : pos + n], pos, pages, slots)])[0, :n])
        pos += n
    return torch.cat(out)


def in_threads(fns, on_error=lambda: None) -> list:
    """Run each function in its own thread; return their results in order, re-raising the
    first exception (after calling `on_error`, e.g. to release ranks waiting at a barrier)."""
    out: list = [None] * len(fns)

    def run(i: int) -> None:
        try:
            out[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - re-raised below
            out[i] = e
            on_error()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for o in out:
        if isinstance(o, BaseException):
            raise o
    return out


def run_ranks(path, tp_size: int, toks: list[int], reduce=True) -> list[torch.Tensor]:
    """Load every rank's shard from `path` and run them concurrently; returns each rank's logits."""
    ar = LockstepAllReduce(tp_size)

    def rank_main(r: int):
        fn = ar.for_rank(r) if reduce else identity_allreduce
        return run_steps(load_model(path, TP(r, tp_size), torch.float64, allreduce=fn), toks)

    # a failing rank releases the ranks waiting for it at the barrier
    return in_threads([lambda r=r: rank_main(r) for r in range(tp_size)], on_error=ar.barrier.abort)


# (layout, kv heads, mamba groups): counts below, equal to and above the TP size
CASES = [
    (layout, n)
    for layout in ("full", "swa", "mamba", "full_swa_mamba")
    for n in (1, 2, 4)
]


def tp_config(layout: str, n: int, **kw):
    return tiny_config(layout, num_attention_heads=8, num_key_value_heads=n, mamba_n_heads=8,
                       mamba_d_head=4, mamba_n_groups=n, **kw)


def checkpoint(tmp_path, layout: str, n: int, **kw):
    model = random_model(tp_config(layout, n, **kw), dtype=torch.float64, seed=n)
    save_model(model, tmp_path)
    return model


def test_cases_include_replicated_kv_heads_and_mamba_groups_split_across_ranks():
    model = HybridModel(tp_config("full_swa_mamba", 1), TP(3, 4), torch.float64)
    kv = {c.name: c.shard_index for c in model.components}
    assert kv["full_kv"] == kv["swa_kv"] == (0,)  # the one KV head, replicated on every rank
    norms = [layer.mamba.norm for layer in model.model.layers if layer.layer_type == "mamba2"]
    assert norms and all(norm.split for norm in norms)  # the gated norm needs its all-reduce


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("layout,n", CASES, ids=[f"{l}-kv_groups{n}" for l, n in CASES])
def test_every_rank_computes_the_unsharded_logits(tmp_path, tp_size, layout, n):
    full = checkpoint(tmp_path, layout, n)
    toks = torch.randint(1, 64, (sum(CHUNKS),), generator=torch.Generator().manual_seed(0)).tolist()
    ref = run_steps(full, toks)
    for r, logits in enumerate(run_ranks(tmp_path, tp_size, toks)):
        torch.testing.assert_close(logits, ref, atol=TOL, rtol=0, msg=lambda m: f"rank {r}: {m}")


@pytest.mark.parametrize("tp_size", [2, 4])
def test_row_parallel_biases_are_added_once_across_ranks(tmp_path, tp_size):
    full = checkpoint(tmp_path, "full_swa_mamba", 2, attention_bias=True, mlp_bias=True, mamba_proj_bias=True)
    toks = list(range(3, sum(CHUNKS) + 3))
    ref = run_steps(full, toks)
    for logits in run_ranks(tmp_path, tp_size, toks):
        torch.testing.assert_close(logits, ref, atol=TOL, rtol=0)


@pytest.mark.parametrize("layout", ["full", "mamba"])
def test_tp_check_notices_a_missing_all_reduce(tmp_path, layout):
    """Mutation check: without the sum over ranks the shards must disagree with the full model."""
    full = checkpoint(tmp_path, layout, 1)
    toks = list(range(1, sum(CHUNKS) + 1))
    ref = run_steps(full, toks)
    got = run_ranks(tmp_path, 2, toks, reduce=False)
    assert (got[0] - ref).abs().max() > 1e-3
