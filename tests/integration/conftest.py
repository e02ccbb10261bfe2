"""Integration-test fixtures: one local Ray cluster per session, deployments reused by
the tests that can share them, and a tiny SWA + Mamba2 checkpoint built once.

Machine budget (2 cores, 24 GB): every torch-importing actor costs ~0.5 GB and seconds to
start, so at most two deployments are alive at any time: the shared demo deployment
(session) and one module's own.
"""
from __future__ import annotations

import os

# Must precede the first `import ray` (ray_harness imports it): keeps a local cluster's
# traffic on 127.0.0.1. init_ray sets the same default.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

from hyrax.actors.engine.commands import SetForcedRetraction  # noqa: E402
from ray_harness import DEMO_CONFIG, DEMO_MODEL, call, deployed, replica  # noqa: E402


@pytest.fixture(scope="session")
def ray_session():
    from hyrax.cluster.ray_cluster import init_ray

    started = init_ray(num_cpus=16, dashboard=False, num_gpus=0)
    import ray

    torch.set_num_threads(1)  # the reference engine shares two cores with the rank actors
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="session")
def demo_deployment(ray_session):
    """demo checkpoint (full + sliding + mamba2): roles "tp1" (TP=1) and "tp2" (TP=2)."""
    from hyrax.cluster.deployment import RoleSpec

    with deployed(DEMO_MODEL, [RoleSpec("tp1", 1, 1), RoleSpec("tp2", 1, 2)], DEMO_CONFIG) as d:
        yield d


@pytest.fixture
def demo_tp2(demo_deployment):
    """The demo TP=2 replica's coordinator; forced retraction is off again afterwards."""
    c = replica(demo_deployment, "tp2").coordinator
    yield c
    call(c.run, SetForcedRetraction(0))


@pytest.fixture(scope="session")
def swa_mamba_model(tmp_path_factory) -> str:
    """A tiny random checkpoint with sliding-window attention and Mamba2 only (no full
    attention), splittable two ways; no tokenizer.json (the byte fallback is used)."""
    from hyrax.actors.model.config import ModelConfig
    from hyrax.actors.model.hybrid import HybridModel
    from hyrax.actors.model.loader import save_model

    cfg = ModelConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128,
        layer_types=("mamba2", "sliding_attention", "mamba2", "sliding_attention"),
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=2, mamba_d_conv=4,
        mamba_chunk_size=8, sliding_window=8, max_position_embeddings=1024,
    )
    model = HybridModel(cfg, dtype=torch.float32)
    g = torch.Generator().manual_seed(1234)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                new = torch.rand(p.shape, generator=g) * 2 - 1
            elif "norm" in name:
                new = 1 + 0.3 * torch.randn(p.shape, generator=g)
            else:
                new = 0.3 * torch.randn(p.shape, generator=g)
            p.copy_(new.to(p.dtype))
    path = tmp_path_factory.mktemp("swa_mamba")
    save_model(model, path)
    return str(path)
