"""Which rank claims a CPU of its own where there are fewer to claim than ranks (rank.py, the
note above RankWorker): a prefill or colocated rank claims before it loads its model, a decode
rank only after, so that a disaggregated deployment's prefill ranks take them first."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from hyrax.actors import rank as rank_module
from hyrax.actors.engine.config import EngineConfig
from hyrax.actors.model.sharding import TP


def _worker():
    """The actor's class as Ray keeps it, made without an actor, and the globals its methods
    read (stood in there: once Ray has made an actor of the class in this process, they may be
    another copy of the module's than `hyrax.actors.rank`'s)."""
    cls = rank_module.RankWorker.__ray_actor_class__
    worker = cls.__new__(cls)
    worker.tp, worker.device, worker._cpus, worker._claims_cpus = TP(0, 1), torch.device("cpu"), None, False
    return cls, worker, cls.setup.__globals__


def _setup_events(monkeypatch, role: str) -> list[str]:
    cls, worker, names = _worker()  # no actor: setup's own steps, recorded
    events: list[str] = []
    monkeypatch.setitem(names, "claim", lambda n: events.append("claim"))
    monkeypatch.setitem(names, "load_model",
                        lambda *a, **k: events.append("load model") or SimpleNamespace(attention_backend_name="sdpa"))
    monkeypatch.setattr(cls, "allocate", lambda self, config: events.append("allocate") or {})
    worker.setup("a model directory", EngineConfig(role=role), None)
    return events


@pytest.mark.parametrize("role", ["prefill", "colocated"])
def test_prefill_and_colocated_ranks_claim_before_loading_their_model(monkeypatch, role):
    assert _setup_events(monkeypatch, role) == ["claim", "load model", "allocate"]


def test_a_decode_rank_claims_after_loading_its_model(monkeypatch):
    assert _setup_events(monkeypatch, "decode") == ["load model", "claim", "allocate"]


def test_no_claim_with_cpu_affinity_off(monkeypatch):
    cls, worker, names = _worker()
    claims: list[int] = []
    monkeypatch.setitem(names, "claim", claims.append)
    monkeypatch.setitem(names, "load_model", lambda *a, **k: SimpleNamespace(attention_backend_name="sdpa"))
    monkeypatch.setattr(cls, "allocate", lambda self, config: {})
    worker.setup("a model directory", EngineConfig(role="decode", cpu_affinity="off"), None)
    assert claims == []
