"""Loading a checkpoint builds the model without initialising weights it is about to overwrite
(issue 21): no random fill, and no op on the meta device, whose first use imports torch's
Python reference kernels (torch._dynamo; seconds per rank actor on two cores)."""
from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import torch
from torch import nn

from hyrax.actors.model.no_init import weights_left_uninitialised

DEMO = Path(__file__).resolve().parents[2] / "hyrax" / "models" / "demo"


def test_loading_the_demo_checkpoint_runs_no_meta_op_and_no_random_fill():
    code = (
        "import sys, torch\n"
        "calls = []\n"
        "real = torch.Tensor.normal_, torch.Tensor.uniform_\n"
        "torch.Tensor.normal_ = lambda self, *a, **k: calls.append('normal_') or real[0](self, *a, **k)\n"
        "torch.Tensor.uniform_ = lambda self, *a, **k: calls.append('uniform_') or real[1](self, *a, **k)\n"
        "from hyrax.actors.model.loader import load_model\n"
        f"m = load_model({str(DEMO)!r}, dtype=torch.float32)\n"
        "print(len(calls), 'torch._dynamo' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).resolve().parents[2])
    fills, dynamo = out.stdout.split()
    assert fills == "0", f"{fills} random fills while loading a checkpoint"
    assert dynamo == "False", "loading touched the meta device's reference kernels (imports torch._dynamo)"


def test_skipping_init_is_for_this_thread_and_this_block_only(monkeypatch):
    fills: list[str] = []
    real = torch.Tensor.uniform_

    def counting(self, *a, **k):
        fills.append(threading.current_thread().name)
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "uniform_", counting)
    with weights_left_uninitialised():
        t = threading.Thread(target=lambda: nn.Linear(8, 8), name="other")
        t.start()
        t.join()
        nn.Linear(8, 8), nn.Conv1d(4, 4, 3), nn.Embedding(5, 3)
    assert fills == ["other", "other"], fills  # weight and bias of the other thread's Linear only
    fills.clear()
    nn.Linear(8, 8)
    assert fills == ["MainThread", "MainThread"], "init stays skipped after the block"
