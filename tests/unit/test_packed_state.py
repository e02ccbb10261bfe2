"""Packed move buffers (hyrax/actors/engine/packed_state.py): several components' rows in one
buffer, hashed in one pass, must give each component exactly the hash `state_hash` gives it
alone (the value the other side of a move compares with), whatever is left in a reused buffer;
and the wide row views a move copies through must carry every bit pattern unchanged.

Also the save/restore protocol with a lane whose device buffers are not the host buffers (what
a GPU rank does: gather on the device, copy to a pinned host buffer, copy back), run on the CPU
with a copying stand-in for the lane."""
from __future__ import annotations

import pytest
import torch

from engine_helpers import HYBRID, greedy, make_engine, make_prompts, tiny_model
from hyrax.actors.engine import packed_state
from hyrax.actors.engine.copy_lane import InlineLane
from hyrax.actors.engine.host_buffers import HostBuffers
from hyrax.actors.engine.packed_state import HASH_ROW_BYTES, Packing, Packings, row_view
from hyrax.actors.engine.state_hash import ROW_WORDS, hasher, state_hash


def _random(shape, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    n = 1
    for d in shape:
        n *= d
    return torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8).view(dtype).view(shape)


SPECS = [
    # (layers, rows, *unit) per part: sizes below, at and above a hash row, odd byte counts
    [((1, 300, 4, 8), torch.float32), ((2, 7, 5), torch.bfloat16), ((3, 1, 13), torch.uint8)],
    [((2, 64, 2), torch.float32), ((1, 0, 16), torch.float32), ((1, 1, 1), torch.float16)],
    [((3, 1, 8, 32, 32), torch.float32)],
]


@pytest.mark.parametrize("dense_max", [0, 1 << 16], ids=["by-part", "dense"])
@pytest.mark.parametrize("spec", SPECS, ids=["mixed", "aligned-and-empty", "one"])
def test_each_part_hashes_as_state_hash_of_it_alone_even_in_a_dirty_reused_buffer(spec, dense_max, monkeypatch):
    monkeypatch.setattr(packed_state, "DENSE_MAX", dense_max)
    h = hasher("cpu")
    packing = Packing(tuple((f"c{k}", shape, dtype) for k, (shape, dtype) in enumerate(spec)), h)
    tensors = {f"c{k}": _random(shape, dtype, seed=k) for k, (shape, dtype) in enumerate(spec)}
    words = torch.full((packing.rows, ROW_WORDS), -1, dtype=torch.int64)  # stale bytes everywhere
    packing.clear_padding(words)
    views = packing.views(words)
    for name, t in tensors.items():
        views[name].copy_(t)
    got = packing.read(packing.hash(words))
    assert got == {name: state_hash(t) for name, t in tensors.items()}
    assert sum(-(-t.numel() * t.element_size() // HASH_ROW_BYTES) for t in tensors.values()) == packing.rows


def test_padding_left_dirty_would_change_the_hash():
    # the check above is not vacuous: without clear_padding the stale bytes are hashed
    h = hasher("cpu")
    packing = Packing((("a", (1, 3, 5), torch.float32),), h)
    t = _random((1, 3, 5), torch.float32, seed=1)
    words = torch.full((packing.rows, ROW_WORDS), -1, dtype=torch.int64)
    packing.views(words)["a"].copy_(t)
    assert packing.read(packing.hash(words))["a"] != state_hash(t)


def test_large_packings_keep_no_weight_matrix_that_grows_with_the_state():
    # a 64 MB state: its dense (parts, hash rows) matrix would be 1 MB per cached spec
    packing = Packing((("a", (1, 1 << 14, 1024), torch.float32), ("b", (3, 1, 2048), torch.float32)), hasher("cpu"))
    assert len(packing.parts) * packing.rows > packed_state.DENSE_MAX and not hasattr(packing, "weights")


def test_packings_are_made_once_per_spec_and_bounded():
    made = Packings(hasher("cpu"), size=2)
    a = made((("a", (1, 4, 2), torch.float32),))
    assert made((("a", (1, 4, 2), torch.float32),)) is a
    made((("a", (1, 5, 2), torch.float32),))
    made((("a", (1, 6, 2), torch.float32),))
    assert made((("a", (1, 4, 2), torch.float32),)) is not a  # evicted, made again


@pytest.mark.parametrize("unit,dtype", [((2, 2, 32), torch.float32), ((3, 3), torch.bfloat16), ((5,), torch.uint8)],
                         ids=["16B", "2B", "1B"])
def test_row_views_copy_every_bit_pattern_exactly(unit, dtype):
    # random bytes include NaN payloads and signalling NaNs of the wide element type (complex128)
    pool = _random((2, 50, *unit), dtype, seed=3)
    wide = row_view(pool)
    assert wide.shape[:2] == (2, 50) and wide.data_ptr() == pool.data_ptr()
    data = row_view(_random((2, 6, *unit), dtype, seed=4))
    rows = torch.tensor([40, 3, 17, 0, 49, 22])
    wide.index_copy_(1, rows, data)
    back = torch.index_select(wide, 1, rows)
    assert torch.equal(back.view(torch.uint8), data.view(torch.uint8))


class CopyingLane(InlineLane):
    """Stand-in for a GPU lane on the CPU: device buffers are separate memory, and every move
    between them and the host buffers is a real copy (as on a GPU: gather on the device, copy to
    a pinned host buffer, and back)."""

    def device_words(self, rows):
        return torch.empty((rows, ROW_WORDS), dtype=torch.int64)

    def to_host(self, words):
        host = self.buffers.take(words.shape, words.dtype)
        host.copy_(words)
        return host

    def to_device(self, words):
        return words.clone()

    def drop(self, words):
        pass


@pytest.mark.parametrize("mode", ["cpu_tensor", "host_pool"])
def test_backup_and_restore_through_separate_device_buffers_verify_and_catch_a_flip(mode):
    e = make_engine(tiny_model(HYBRID, torch.float32), retraction_backup=mode)
    rank = e.executor.rank
    rank.lane = CopyingLane(rank.buffers)
    ids = [e.add_request(p, greedy(max_tokens=40)) for p in make_prompts(2, seed=5, lo=20, hi=30)]
    for _ in range(100):
        if all(len(e.requests[i].output_ids) >= 2 for i in ids):
            break
        e.step()
    a, b = ids
    assert e.retract([a, b], mode=mode, hold=True) == {a: mode, b: mode}
    assert e.resume([a])[a].value == "verified"
    if mode == "cpu_tensor":
        rank.backups[b].parts["full_kv"].view(torch.uint8)[0, 1, 3] ^= 4
    else:
        row = e.requests[b].backup.location.host_rows["full_kv"][1]
        rank.host["full_kv"][0, row].view(-1).view(torch.uint8)[3] ^= 4
    assert e.resume([b])[b].value == "checksum_mismatch"
    assert rank.buffers.lent == 0
    assert isinstance(rank.buffers, HostBuffers)


def test_views_of_a_buffer_that_starts_inside_its_storage():
    # a packed buffer need not start at its storage's first byte (a slice of a larger buffer)
    h = hasher("cpu")
    packing = Packing((("a", (1, 2, 3), torch.float32), ("b", (2, 1, 4), torch.bfloat16)), h)
    big = torch.zeros((packing.rows + 3, ROW_WORDS), dtype=torch.int64)
    words = big[3:]
    views = packing.views(words)
    views["a"].fill_(1.5)
    views["b"].fill_(-2.0)
    assert big[:3].eq(0).all()
    assert views["a"].data_ptr() == words.data_ptr()
    assert torch.equal(views["b"].float(), torch.full((2, 1, 4), -2.0))
