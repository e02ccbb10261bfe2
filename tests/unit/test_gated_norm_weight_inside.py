"""GatedGroupRMSNorm with one whole group on the rank multiplies its weight inside the rms_norm
call (decided at construction): the same bits as normalising and multiplying separately, for
both gate orders and for float32 states of a bf16 model."""
from __future__ import annotations

import pytest
import torch

from hyrax.actors.model.norm import GatedGroupRMSNorm, identity_allreduce


@pytest.mark.parametrize("norm_first", [False, True], ids=["gate_then_norm", "norm_then_gate"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=str)
def test_weight_inside_rms_norm_gives_the_separate_products_bits(norm_first, dtype):
    g = torch.Generator().manual_seed(0)
    norm = GatedGroupRMSNorm(48, 0, 48, 1, 1e-5, dtype, identity_allreduce, norm_first=norm_first)
    assert norm.weight_inside
    with torch.no_grad():
        norm.weight.copy_((1 + 0.3 * torch.randn(48, generator=g)).to(dtype))
    f = torch.promote_types(dtype, torch.float32)  # y is the SSM state's dtype
    y = torch.randn(5, 3, 48, generator=g).to(f) * 3
    z = torch.randn(5, 3, 48, generator=g).to(dtype)
    got = norm(y, z)
    norm.weight_inside = False  # the separate weight product
    want = norm(y, z)
    assert got.dtype == f and torch.equal(got, want)


def test_groups_that_do_not_fill_the_rank_alone_keep_the_separate_product():
    assert not GatedGroupRMSNorm(96, 0, 48, 2, 1e-5, torch.float32, identity_allreduce).weight_inside
    assert not GatedGroupRMSNorm(24, 24, 48, 2, 1e-5, torch.float32, identity_allreduce).weight_inside
