"""The test suites' local Ray clusters have no GPUs, even on a GPU host: a rank there must not
ask for one (TP=2 placement waited forever on a one-GPU host)."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import ray

from hyrax.cluster import ray_cluster
from hyrax.cluster.ray_cluster import init_ray

TESTS = Path(__file__).resolve().parents[1]


@pytest.fixture
def ray_init_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.setattr(ray_cluster, "check_reachable", lambda address: None)  # no cluster at the test's address
    return calls


def test_a_local_cluster_gets_the_gpu_count_asked_for(ray_init_calls):
    assert init_ray(num_cpus=4, dashboard=False, num_gpus=0) is True
    assert init_ray(num_cpus=4, dashboard=False) is True
    assert [c["num_gpus"] for c in ray_init_calls] == [0, None]  # None: Ray counts the GPUs
    assert init_ray(address="10.0.0.1:6379", num_gpus=0) is False  # joining: the cluster decides
    assert "num_gpus" not in ray_init_calls[-1]


def _init_ray_calls(path: Path) -> list[ast.Call]:
    tree = ast.parse(path.read_text())
    return [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "init_ray"]


def test_every_test_cluster_starts_without_gpus():
    found = {}
    for path in sorted(TESTS.rglob("conftest.py")):
        for call in _init_ray_calls(path):
            kw = {k.arg: k.value for k in call.keywords}
            found[f"{path.relative_to(TESTS)}:{call.lineno}"] = (
                isinstance(kw.get("num_gpus"), ast.Constant) and kw["num_gpus"].value == 0)
    assert len(found) >= 3, found  # integration, e2e, observability
    assert all(found.values()), found
