"""The device-side state hash (hyrax/actors/engine/state_hash.py): on the function itself, and
through the real backup -> restore path of a rank (RankRuntime via an Engine), where a corrupted
backup must come back as a checksum mismatch (then rebuilt by prefill), never as a verified
restore.

Corruption is injected into the backup the rank holds (its RANK_MEMORY tensors or its host pool
rows), between the retraction and the resume, as memory corruption would."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import HYBRID, HYBRID_COMPONENTS, make_engine, make_prompts, greedy, tiny_model
import hyrax.actors.engine.state_hash as state_hash_module
from hyrax.actors.engine.state_hash import (
    LENGTH_MIX, MASK, ROW_WORDS, DeviceHasher, _mul_sum, _mul_sum_rows, odd_weights, state_hash, state_hashes,
)

DTYPES = (torch.bfloat16, torch.float32, torch.float16, torch.int32, torch.int64, torch.uint8)


def _random(shape, dtype, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (*shape[:-1], shape[-1] * dtype.itemsize), generator=g,
                         dtype=torch.uint8).view(dtype)


def _reference(t: torch.Tensor) -> int:
    """The definition, in Python integers: sum over words of v[row] * w[col] * word, + length."""
    b = bytes(t.contiguous().view(-1).view(torch.uint8).tolist())
    b += bytes(-len(b) % 8)
    words = [int.from_bytes(b[i:i + 8], "little") for i in range(0, len(b), 8)]
    w = odd_weights(0, ROW_WORDS).view("uint64").tolist()
    v = odd_weights(1 << 40, len(words) // ROW_WORDS + 1).view("uint64").tolist()
    h = sum(v[i // ROW_WORDS] * w[i % ROW_WORDS] * x for i, x in enumerate(words))
    return (h + len(t.contiguous().view(-1).view(torch.uint8)) * LENGTH_MIX) & MASK


# ---- the function ----------------------------------------------------------------------------

@pytest.mark.parametrize("shape", [(3,), (5, 7), (2, 300, 3), (3, ROW_WORDS * 2, 4), (0,)])
def test_hash_equals_its_definition_in_python_integers(shape):
    for dtype in (torch.bfloat16, torch.float32, torch.uint8):
        t = _random(shape, dtype, seed=len(shape))
        assert state_hash(t) == _reference(t)


@pytest.mark.parametrize("flat_max", [0, 3 * ROW_WORDS, 1 << 20])
def test_every_path_gives_the_same_hash(monkeypatch, flat_max):
    # flat_max 0: every tensor takes the row-wise form (mv / row sums), as tensors over
    # FLAT_MAX_WORDS do; else those up to flat_max words take the one dot with expanded weights
    shapes = [(1,), (ROW_WORDS * 8,), (4, 999, 8), (2, 37, 3, 5), (3, ROW_WORDS + 1)]
    want = [_reference(_random(shape, torch.float32, seed=sum(shape))) for shape in shapes[:3]]
    monkeypatch.setattr(state_hash_module, "FLAT_MAX_WORDS", flat_max)
    fast = DeviceHasher(torch.device("cpu"))
    slow = DeviceHasher(torch.device("cpu"))  # the elementwise forms CUDA uses
    slow.row_sums, slow.dot = _mul_sum_rows, _mul_sum
    ts = [_random(shape, torch.float32, seed=sum(shape)) for shape in shapes]
    assert fast.many(ts) == slow.many(ts)
    assert fast.many(ts[:3]) == want


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_every_single_bit_flip_of_a_word_changes_the_hash(dtype):
    # words in a whole hash row, in the partial last row, and the zero-padded tail
    t = _random((3, 2 * ROW_WORDS + 7), dtype)
    h = state_hash(t)
    nbytes = t.numel() * t.element_size()
    for word_start in (0, 8 * 123, 8 * (nbytes // 8 - 1), nbytes - nbytes % 8 if nbytes % 8 else nbytes - 8):
        for bit in range(64):
            byte = word_start + bit // 8
            if byte >= nbytes:
                continue
            bad = t.clone()
            bad.view(-1).view(torch.uint8)[byte] ^= 1 << (bit % 8)
            assert state_hash(bad) != h, (dtype, word_start, bit)


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float32, torch.int64), ids=str)
def test_swapped_rows_a_row_from_elsewhere_and_missing_rows_change_the_hash(dtype):
    # t: (layers, rows, *unit), as a backup of one component
    t = _random((2, 40, 4, 8), dtype, seed=1)
    other = _random((2, 40, 4, 8), dtype, seed=2)
    h = state_hash(t)
    for i, j in [(0, 1), (3, 17), (5, 39)]:
        swapped = t.clone()
        swapped[:, [i, j]] = t[:, [j, i]]
        assert state_hash(swapped) != h
    foreign = t.clone()
    foreign[:, 11] = other[:, 11]
    assert state_hash(foreign) != h
    layers_swapped = t.flip(0).contiguous()
    assert state_hash(layers_swapped) != h
    assert state_hash(t[:, :-1]) != h  # a row missing
    zero_tail = torch.cat([t.view(-1).view(torch.uint8), torch.zeros(8, dtype=torch.uint8)])
    assert state_hash(zero_tail) != state_hash(t.view(-1).view(torch.uint8))  # longer by zeros


def test_same_bytes_give_the_same_hash_whatever_the_layout():
    t = _random((4, 50, 6), torch.float32, seed=3)
    h = state_hash(t)
    assert state_hash(t.transpose(0, 2).contiguous().transpose(0, 2)) == h  # non-contiguous view
    assert state_hash(t.view(-1)) == h and state_hash(t.view(torch.uint8)) == h
    big = torch.zeros(1 + t.numel(), dtype=torch.float32)
    big[1:] = t.view(-1)
    assert state_hash(big[1:].view(t.shape)) == h  # storage offset not on an 8-byte boundary
    pool = torch.zeros(4, 80, 6)
    rows = torch.tensor([7, 3, 60] + list(range(10, 57)))
    pool[:, rows] = t
    assert state_hash(pool[:, rows]) == h and state_hash(pool.index_select(1, rows)) == h
    assert state_hashes([t, pool[:, rows], t[:1]]) == [h, h, state_hash(t[:1].clone())]


def test_different_dtypes_with_the_same_bytes_hash_alike_and_the_hash_is_64_bits():
    t = _random((9, 16), torch.bfloat16, seed=4)
    assert state_hash(t) == state_hash(t.view(torch.int16)) == state_hash(t.view(torch.uint8))
    hs = {state_hash(_random((5, 8), torch.float32, seed=s)) for s in range(200)}
    assert len(hs) == 200 and max(hs) >= 1 << 60 and min(hs) >= 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_hash_equals_cpu_hash_of_the_same_bytes():
    for shape, dtype in [((3, 777, 8), torch.bfloat16), ((2, ROW_WORDS * 3), torch.float32), ((13,), torch.uint8)]:
        t = _random(shape, dtype, seed=5)
        assert state_hash(t.cuda()) == state_hash(t)
        assert state_hash(t.cuda().transpose(0, -1)) == state_hash(t.transpose(0, -1))


# ---- through a rank's backup and restore -------------------------------------------------------

def _running_engine(dtype: torch.dtype, n: int = 2, mode: str = "cpu_tensor"):
    e = make_engine(tiny_model(HYBRID, dtype), retraction_backup=mode)
    ids = [e.add_request(p, greedy(max_tokens=50)) for p in make_prompts(n, seed=7, lo=20, hi=30)]
    for _ in range(200):
        if all(len(e.requests[i].output_ids) >= 2 for i in ids):
            break
        e.step()
    return e, ids


def _retract(e, rid: str, mode: str = "cpu_tensor") -> None:
    assert e.retract([rid], mode=mode, hold=True)[rid] == mode


def _backup_of(e, rid: str) -> dict[str, torch.Tensor]:
    """The rank's saved tensors of `rid` (layers, rows, *unit) per component: the real ones."""
    return e.executor.rank.backups[rid].parts


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_a_backup_restores_verified_when_untouched(dtype):
    e, [rid, _] = _running_engine(dtype)
    _retract(e, rid)
    assert e.resume([rid])[rid].value == "verified"
    assert e.stats.checksum_failures == 0


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
@pytest.mark.parametrize("component", HYBRID_COMPONENTS)
def test_a_single_flipped_bit_in_a_backup_is_caught_by_the_restore(component, dtype):
    e, [rid, _] = _running_engine(dtype)
    failures = 0
    for bit in (0, 1, 7, 8, 15, 16, 31, 32, 47, 63):
        _retract(e, rid)
        data = _backup_of(e, rid)[component]
        word = data.view(-1).view(torch.uint8)[8 * (data.numel() * data.element_size() // 16):][:8]
        word[bit // 8] ^= 1 << (bit % 8)
        assert e.resume([rid])[rid].value == "checksum_mismatch", (component, bit)
        failures += 1
        assert e.stats.checksum_failures == failures
        for _ in range(100):  # rebuilt by prefill: running with state again
            if e.requests[rid].num_computed > 0 and rid in {r.id for r in e.running}:
                break
            e.step()


@pytest.mark.parametrize("component", ("full_kv", "swa_kv"))
def test_swapped_rows_in_a_backup_are_caught_by_the_restore(component):
    e, [rid, _] = _running_engine(torch.float32)
    _retract(e, rid)
    data = _backup_of(e, rid)[component]  # (layers, rows, *unit)
    assert data.shape[1] >= 2 and not torch.equal(data[:, 0], data[:, 1])
    data[:, [0, 1]] = data[:, [1, 0]].clone()
    assert e.resume([rid])[rid].value == "checksum_mismatch"


def test_a_row_from_another_requests_backup_is_caught_by_the_restore():
    e, [a, b] = _running_engine(torch.float32)
    _retract(e, a)
    _retract(e, b)
    mine, theirs = _backup_of(e, a)["full_kv"], _backup_of(e, b)["full_kv"]
    assert not torch.equal(mine[:, 3], theirs[:, 3])
    mine[:, 3] = theirs[:, 3]
    assert e.resume([a])[a].value == "checksum_mismatch"
    assert e.resume([b])[b].value == "verified"


def test_a_backup_missing_a_component_is_not_restored():
    e, [rid, _] = _running_engine(torch.float32)
    _retract(e, rid)
    del _backup_of(e, rid)["mamba_ssm"]
    assert e.resume([rid])[rid].value == "checksum_mismatch"


def test_a_flipped_bit_in_the_host_pool_is_caught_by_the_restore():
    e, [rid, _] = _running_engine(torch.float32, mode="host_pool")
    _retract(e, rid, mode="host_pool")
    rows = e.requests[rid].backup.location.host_rows["mamba_conv"]
    e.executor.rank.host["mamba_conv"][1, rows[0]].view(-1).view(torch.uint8)[5] ^= 0x10
    assert e.resume([rid])[rid].value == "checksum_mismatch"


def test_weights_grown_for_a_call_are_the_ones_it_uses_when_another_thread_stores_shorter_ones():
    """One hasher serves every thread of a process. Thread B grows the row weights to 1,024 and,
    before it reads them, thread A (which checked earlier, when 100 were enough) stores its 128:
    B must still get 1,000 weights (the fused kernels read that many), not a view of A's 128."""
    import torch

    from hyrax.actors.engine import state_hash as sh

    class Interleaved(sh.DeviceHasher):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if name == "row_weights" and len(value) >= 1024:  # A's store lands right after B's
                super().__setattr__(name, torch.from_numpy(sh.row_weights(128)))

    h = Interleaved(torch.device("cpu"))
    v = h.row_weight_prefix(1000)
    assert len(v) == 1000 and torch.equal(v, torch.from_numpy(sh.row_weights(1000)))
    t = torch.arange(300 * sh.ROW_WORDS * 8 + 40, dtype=torch.uint8)  # 300 whole hash rows and a part
    assert sh.with_length(int(h.tensor(t)), t.numel()) == sh.state_hash(t)
