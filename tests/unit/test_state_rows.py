"""The fused row moves of CPU backups and restores (state_rows.py, kernels/state_rows.c): the
same bytes as torch's gather and scatter, and the same hash as `state_hash` of those bytes."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.engine.state_hash import LENGTH_MIX, MASK, hasher, state_hash
from hyrax.actors.engine.state_rows import fused_row_moves

MOVES = fused_row_moves(hasher("cpu"))
pytestmark = pytest.mark.skipif(MOVES is None, reason="no C compiler here: backups keep the torch path")

# (layers, pool rows, row shape, dtype): rows of 6 B (odd, staged), 32 B, 512 B and 4 KB
# (hashed where they lie on a scatter), and whole hash rows of 2 KB
SHAPES = [
    (2, 40, (3,), torch.int16),
    (1, 64, (2,), torch.complex128),
    (3, 300, (32,), torch.complex128),
    (2, 50, (512,), torch.int64),
    (1, 20, (256,), torch.int64),
]


def _pool(layers, rows, unit, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    nbytes = layers * rows * torch.Size(unit).numel() * dtype.itemsize
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).view(layers, rows, *unit), g


def _hash(raw: int, t: torch.Tensor) -> int:
    return (raw + t.numel() * t.element_size() * LENGTH_MIX) & MASK


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8)


@pytest.mark.parametrize("layers,rows,unit,dtype", SHAPES)
@pytest.mark.parametrize("n", [0, 1, 5, "all"])
def test_gather_writes_the_rows_and_hashes_them_as_state_hash_does(layers, rows, unit, dtype, n):
    pool, g = _pool(layers, rows, unit, dtype, 1)
    idx = torch.randperm(rows, generator=g)[:rows if n == "all" else n]
    want = pool.index_select(1, idx)
    nbytes = want.numel() * want.element_size()
    out = torch.zeros(nbytes + 64, dtype=torch.uint8)
    raw = MOVES.gather(pool.view(layers, rows, -1), idx, out.data_ptr())
    assert torch.equal(out[:nbytes], _bytes(want))
    assert not out[nbytes:].any()  # nothing written past the rows
    assert _hash(raw, want) == state_hash(want)


@pytest.mark.parametrize("layers,rows,unit,dtype", SHAPES)
@pytest.mark.parametrize("n", [1, 7, "all"])
def test_scatter_writes_the_rows_and_hashes_what_they_hold(layers, rows, unit, dtype, n):
    pool, g = _pool(layers, rows, unit, dtype, 2)
    idx = torch.randperm(rows, generator=g)[:rows if n == "all" else n]
    src, _ = _pool(layers, idx.shape[0], unit, dtype, 3)
    want = pool.clone()
    want.index_copy_(1, idx, src)
    raw = MOVES.scatter(pool.view(layers, rows, -1), idx, src.reshape(layers, idx.shape[0], -1))
    assert torch.equal(_bytes(pool), _bytes(want))
    assert _hash(raw, src) == state_hash(want.index_select(1, idx)) == state_hash(src)


@pytest.mark.parametrize("unit,dtype", [((3,), torch.int16), ((32,), torch.complex128)])
def test_a_row_given_twice_to_a_scatter_shows_in_its_hash(unit, dtype):
    """Rows are read back after all of a layer's writes: the first copy of a twice-given row is
    overwritten, so what the rows hold differs from what was meant to be written (a read-back
    right after each write would miss it)."""
    pool, _ = _pool(2, 10, unit, dtype, 4)
    src, _ = _pool(2, 3, unit, dtype, 5)
    idx = torch.tensor([4, 7, 4])
    raw = MOVES.scatter(pool.view(2, 10, -1), idx, src.reshape(2, 3, -1))
    assert _hash(raw, src) != state_hash(src)
    assert _hash(raw, src) == state_hash(pool.index_select(1, idx))


def test_scatters_with_and_without_a_twice_given_row_each_hash_what_their_rows_hold():
    """Distinct rows are read back right after each write; a call with a row given twice (anywhere
    in a long list, the last row repeating the first or two neighbours the same) reads each layer
    back after all of its writes. The kernel's record of the rows a call gave is per call: calls
    after a twice-given row still write and hash right."""
    layers, rows, unit, dtype = 2, 5000, (32,), torch.complex128
    pool, g = _pool(layers, rows, unit, dtype, 8)
    for k, dup in enumerate([None, (0, 199), None, (57, 58), None]):
        idx = torch.randperm(rows, generator=g)[:200]
        if dup is not None:
            idx[dup[1]] = idx[dup[0]]
        src, _ = _pool(layers, 200, unit, dtype, 20 + k)
        want = pool.clone()
        want.index_copy_(1, idx, src)
        raw = MOVES.scatter(pool.view(layers, rows, -1), idx, src.reshape(layers, 200, -1))
        assert torch.equal(_bytes(pool), _bytes(want))
        assert _hash(raw, src) == state_hash(pool.index_select(1, idx))
        assert (_hash(raw, src) == state_hash(src)) == (dup is None)


@pytest.mark.parametrize("bad", [-1, 10])
def test_a_row_outside_the_pool_is_refused_before_anything_is_written(bad):
    pool, _ = _pool(2, 10, (4,), torch.int64, 6)
    before = pool.clone()
    idx = torch.tensor([1, bad])
    with pytest.raises(RuntimeError, match="outside the pool"):
        MOVES.scatter(pool, idx, torch.zeros(2, 2, 4, dtype=torch.int64))
    assert torch.equal(pool, before)
    out = torch.zeros(2 * 2 * 32, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="outside the pool"):
        MOVES.gather(pool, idx, out.data_ptr())
    assert not out.any()


def test_many_moves_in_one_call_are_each_the_single_move():
    """gather_many / scatter_many: each move's bytes and hash as the single call gives them; a bad
    row in any move is refused before any move writes."""
    pools = [_pool(*shape, 30 + k)[0] for k, shape in enumerate(SHAPES)]
    g = torch.Generator().manual_seed(9)
    idxs = [torch.randperm(p.shape[1], generator=g)[:3] for p in pools]
    views = [p.view(p.shape[0], p.shape[1], -1) for p in pools]
    sizes = [p.shape[0] * 3 * v.shape[2] * p.element_size() for p, v in zip(pools, views)]
    outs = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
    raws = MOVES.gather_many([(v, i, o.data_ptr()) for v, i, o in zip(views, idxs, outs)])
    for v, i, o, raw in zip(views, idxs, outs, raws):
        single = torch.zeros_like(o)
        assert MOVES.gather(v, i, single.data_ptr()) == raw
        assert torch.equal(single, o)
    srcs = [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in sizes]
    before = [p.clone() for p in pools]
    bad = [i.clone() for i in idxs]
    bad[-1][1] = pools[-1].shape[1]
    with pytest.raises(RuntimeError, match="outside the pool"):
        MOVES.scatter_many([(v, i, s) for v, i, s in zip(views, bad, srcs)])
    assert all(torch.equal(_bytes(p), _bytes(b)) for p, b in zip(pools, before))
    raws = MOVES.scatter_many([(v, i, s) for v, i, s in zip(views, idxs, srcs)])
    for p, i, s, raw in zip(pools, idxs, srcs, raws):
        assert torch.equal(_bytes(p.index_select(1, i)), s)
        assert _hash(raw, s) == state_hash(s)


def test_arguments_that_do_not_fit_are_refused():
    pool, _ = _pool(2, 10, (4,), torch.int64, 7)
    with pytest.raises(ValueError, match="do not fit"):
        MOVES.scatter(pool, torch.tensor([1]), torch.zeros(2, 1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="int64"):
        MOVES.gather(pool, torch.tensor([1], dtype=torch.int32), 0)
    with pytest.raises(ValueError, match="contiguous"):
        MOVES.gather(pool.transpose(0, 1), torch.tensor([1]), 0)


def test_a_cpu_rank_backs_up_and_restores_through_the_fused_moves(monkeypatch):
    """The engine's CPU rank takes this path (one kernel call per side for all components), and
    its hashes are the ones the torch path gives for the same request."""
    from tests.unit.test_state_hash import _retract, _running_engine

    calls = []
    for name in ("gather_many", "scatter_many"):
        real = getattr(type(MOVES), name)
        monkeypatch.setattr(type(MOVES), name,
                            lambda self, moves, _r=real, _n=name: calls.append((_n, len(moves))) or _r(self, moves))
    e, [rid, _] = _running_engine(torch.float32)
    rank = e.executor.rank
    assert rank.fused is not None
    _retract(e, rid)
    fused_sums = {n: r.checksums for n, r in e.requests[rid].backup.manifest.components.items()}
    assert e.resume([rid])[rid].value == "verified"
    n = len(rank.components)
    assert calls == [("gather_many", n), ("scatter_many", n)]
    rank.fused = None  # the torch path, same request, same rows
    _retract(e, rid)
    assert {n: r.checksums for n, r in e.requests[rid].backup.manifest.components.items()} == fused_sums
    assert e.resume([rid])[rid].value == "verified"


def test_a_cpu_hand_off_exports_and_imports_through_the_fused_moves(monkeypatch):
    """PD hand-off on CPU ranks: the exporter gathers into the shard and hashes in one pass, the
    importer writes and hashes in one pass; the hashes are the torch path's."""
    from tests.unit.test_state_shard import _offer

    src, dst, rid, handoff = _offer()
    assert src.executor.rank.fused is not None and dst.executor.rank.fused is not None
    [shard] = handoff["payload"]
    for name, rec in handoff["manifest"].components.items():
        assert rec.checksums == {0: state_hash(shard.tensor(name))}
    calls = []
    real = type(MOVES).scatter
    monkeypatch.setattr(type(MOVES), "scatter", lambda self, *a: calls.append(1) or real(self, *a))
    assert dst.import_request(handoff).value == "verified"
    assert len(calls) == len(dst.executor.rank.components)
    src.release_handoff(rid)
