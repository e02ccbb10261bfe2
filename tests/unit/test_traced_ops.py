"""traced_ops.define (hyrax/actors/model/traced_ops.py): an operator that writes into its
arguments is defined only where torch.compile keeps those writes right; one that only reads
them is defined on every torch that can define operators."""
from __future__ import annotations

import itertools

import pytest
import torch

from hyrax.actors.model import traced_ops

_NAMES = itertools.count()


def _name(kind: str) -> str:
    return f"test_{kind}_{next(_NAMES)}"  # operators live as long as the process: never twice


def _double_(x):
    x.mul_(2)
    return x.clone()


@pytest.mark.parametrize("compiles_writes", [True, False], ids=["writes_compiled_right", "writes_compiled_wrong"])
def test_a_writing_operator_is_defined_only_where_its_writes_compile_right(monkeypatch, compiles_writes):
    """Where they do not (torch 2.4-2.6: a view's offset counted twice, the Mamba2 step read
    another layer's state), define gives None and traced code keeps the torch path."""
    monkeypatch.setattr(traced_ops, "WRITES_INTO_INPUT_VIEWS", compiles_writes)
    name = _name("writes")
    op = traced_ops.define(name, "(Tensor(a!) x) -> Tensor", _double_, lambda x: torch.empty_like(x))
    if not compiles_writes:
        assert op is None and not hasattr(torch.ops.hyrax, name)
        return
    x = torch.ones(3)
    assert torch.equal(op(x), torch.full((3,), 2.0)) and torch.equal(x, torch.full((3,), 2.0))


def test_a_reading_operator_is_defined_whatever_torch_compiles_wrong(monkeypatch):
    monkeypatch.setattr(traced_ops, "WRITES_INTO_INPUT_VIEWS", False)
    op = traced_ops.define(_name("reads"), "(Tensor x) -> Tensor", lambda x: x * 3, lambda x: torch.empty_like(x))
    assert op is not None and torch.equal(op(torch.ones(2)), torch.full((2,), 3.0))


def test_the_mamba2_operator_follows_this_torch():
    """The model's one writing operator (hyrax::mamba2_decode) exists exactly where this torch
    compiles its writes right; the attention operator, which writes nothing, everywhere."""
    from hyrax.actors.model.mamba2_rows import traced_mamba2_decode
    from hyrax.actors.model.paged_decode import traced_paged_decode

    assert (traced_mamba2_decode is not None) == traced_ops.WRITES_INTO_INPUT_VIEWS
    assert traced_paged_decode is not None
