"""`--dtype auto` (the default, issue 18): float32 on the CPU, bfloat16 on GPUs that compute
it natively (sm80 and up), float16 before - the dtypes the FlashAttention backend runs, which
a float32 default never picked. Resolved where the ranks run (the coordinator sizes its
pools with the dtype its ranks report)."""
from __future__ import annotations

import argparse

import pytest
import torch

from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.errors import HyraxInputError
from hyrax.actors.model.hybrid import resolve_dtype
from hyrax.cluster.engine_args import add_engine_args, engine_config_from_args


def _cap(major: int, minor: int = 0):
    return lambda device: (major, minor)


def test_auto_is_float32_on_the_cpu_and_a_half_type_on_cuda():
    assert resolve_dtype("auto", "cpu") == torch.float32
    assert resolve_dtype("auto", "cuda:0", _cap(9)) == torch.bfloat16  # H100/H200
    assert resolve_dtype("auto", "cuda:0", _cap(8, 6)) == torch.bfloat16  # A10/RTX 30xx
    assert resolve_dtype("auto", "cuda:0", _cap(7, 5)) == torch.float16  # T4
    assert resolve_dtype("auto", "cuda:0", _cap(7)) == torch.float16  # V100
    for name, dt in (("float32", torch.float32), ("bfloat16", torch.bfloat16), ("float64", torch.float64)):
        assert resolve_dtype(name, "cuda:0", _cap(9)) == dt == resolve_dtype(name, "cpu")


def test_auto_is_the_command_line_default_and_unknown_names_are_refused():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args([])).dtype == "auto"
    assert "auto" in p.format_help()
    with pytest.raises(HyraxInputError, match="dtype"):
        EngineConfig(dtype="float8")
