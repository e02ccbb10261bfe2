"""Unit-test settings shared by every module in this folder."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def single_intra_op_thread():
    """Run torch single-threaded: the tensors here are tiny, and OpenMP workers spinning on a
    busy machine (or beside test_tp_math's rank threads) make such ops 10-100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
