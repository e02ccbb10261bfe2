"""index_copy_rows_ (the pools' row scatter, as wide elements) writes exactly what index_copy_
writes, for every row size and dtype the pools use and for rows that are not contiguous;
index_select_rows (the gather) reads exactly what index_select reads."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.row_copy import index_copy_rows_, index_select_rows, wide_dtype


UNITS = [
    ((8, 32, 32), torch.float32),   # an SSM row: 16-byte elements
    ((384, 3), torch.float32),      # a conv row
    ((2, 2, 32), torch.bfloat16),   # a KV row in bf16
    ((3,), torch.float32),          # 12 bytes: 4-byte elements
    ((5,), torch.bfloat16),         # 10 bytes: 2-byte elements
    ((7,), torch.uint8),            # 7 bytes: bytes
    ((4, 4), torch.float64),
]


@pytest.mark.parametrize("unit,dtype", UNITS)
def test_matches_index_copy_bit_for_bit(unit, dtype):
    g = torch.Generator().manual_seed(0)
    pool = (torch.randn(20, *unit, generator=g) * 100).to(dtype)
    rows = (torch.randn(6, *unit, generator=g) * 100).to(dtype)
    index = torch.tensor([7, 0, 19, 3, 12, 5])
    want = pool.clone().index_copy_(0, index, rows)
    got = index_copy_rows_(pool, index, rows)
    assert got is pool
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


@pytest.mark.parametrize("unit,dtype", UNITS)
def test_gather_matches_index_select_bit_for_bit(unit, dtype):
    g = torch.Generator().manual_seed(1)
    pool = (torch.randn(20, *unit, generator=g) * 100).to(dtype)
    index = torch.tensor([7, 0, 19, 3, 7, 12])  # a row twice
    got = index_select_rows(pool, index)
    want = pool.index_select(0, index)
    assert got.shape == want.shape and got.dtype == want.dtype and got.is_contiguous()
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    assert index_select_rows(pool, index[:0]).shape == (0, *unit)
    layered = pool.view(2, 10, *unit)[1]  # one layer of a pool of layers: starts mid-buffer
    assert torch.equal(index_select_rows(layered, index % 10).view(torch.uint8),
                       layered.index_select(0, index % 10).view(torch.uint8))


def test_gather_of_a_pool_that_is_not_contiguous_reads_its_values():
    pool = torch.arange(10 * 3 * 4, dtype=torch.float32).view(10, 4, 3).transpose(1, 2)  # (10, 3, 4), strided
    assert torch.equal(index_select_rows(pool, torch.tensor([9, 2])), pool[[9, 2]])


def test_rows_that_are_not_contiguous_are_written_as_their_values():
    pool = torch.zeros(10, 4, 3)
    rows = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4).transpose(1, 2)  # (2, 4, 3), strided
    index_copy_rows_(pool, torch.tensor([9, 2]), rows)
    assert torch.equal(pool[9], rows[0]) and torch.equal(pool[2], rows[1])
    assert int((pool != 0).any(dim=(1, 2)).sum()) == 2


def test_the_element_follows_row_size_and_alignment():
    t = torch.zeros(64, dtype=torch.uint8)
    assert wide_dtype(64, t) == torch.complex128
    assert wide_dtype(24, t) == torch.int64
    assert wide_dtype(64, t[4:]) == torch.int32  # a start 4 bytes into the buffer
    assert wide_dtype(3, t) == torch.uint8


def test_a_write_autograd_records_keeps_its_gradient():
    """Training writes K/V into a pool and backpropagates through the pool's rows."""
    pool = torch.zeros(6, 4)
    rows = torch.randn(2, 4, requires_grad=True)
    out = index_copy_rows_(pool, torch.tensor([1, 4]), rows * 2)
    out.sum().backward()
    assert torch.equal(rows.grad, torch.full((2, 4), 2.0))


def test_inside_a_compiled_graph_it_is_one_graph_of_plain_index_copy():
    """The captured decode step compiles the model: the scatter traces as one graph of the pool's
    own dtype (inductor generates no code for complex operators and falls back to eager ones,
    which a complex128 view would have cost every Mamba layer's write)."""
    import torch._dynamo

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def write(pool, index, rows):
        return index_copy_rows_(pool, index, rows * 1.0)

    torch._dynamo.reset()
    pool, rows, index = torch.zeros(8, 4, 4), torch.randn(3, 4, 4), torch.tensor([5, 1, 6])
    got = torch.compile(write, backend=record, fullgraph=True)(pool.clone(), index, rows)
    assert torch.equal(got, pool.clone().index_copy_(0, index, rows))
    assert len(graphs) == 1
    dtypes = {n.meta["example_value"].dtype for n in graphs[0].graph.nodes
              if isinstance(n.meta.get("example_value"), torch.Tensor)}
    assert dtypes <= {torch.float32, torch.int64}, dtypes
