"""End-to-end fixtures: the gateway served over HTTP on 127.0.0.1, backed by an in-process
engine (session) or by a Ray deployment (one module), driven with the official `openai`
client and httpx.

Ray allows one cluster per process and tests/integration starts one too: `ray_cluster`
joins a running one and only shuts down a cluster it started itself.
"""
from __future__ import annotations

import os

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # before the first `import ray`

from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402

from e2e_harness import (  # noqa: E402
    ADMIN_TOKEN, DEMO_MODEL, E2E_CONFIG, MODEL, Gateway, RecordingClient, gateway_is_idle, local_gateway,
    wait_until,
)


@dataclass
class RayStack:
    url: str
    app: object
    client: RecordingClient
    deployment: object

    def is_idle(self) -> bool:
        return gateway_is_idle(self.url)


@pytest.fixture(scope="session")
def local_stack():
    import torch

    torch.set_num_threads(1)  # the engine thread shares two cores with uvicorn and the test
    with local_gateway(E2E_CONFIG) as stack:
        yield stack


@pytest.fixture
def local(local_stack):
    """The in-process stack; after the test it must be idle with clean pools (STYLE §9)."""
    yield local_stack
    local_stack.loop.set_forced_retraction(0)
    wait_until(local_stack.loop.is_idle_clean, 20, what="the engine to be idle with empty pools")
    assert local_stack.loop.check_invariants()


@pytest.fixture
def gateway_with(local_stack):
    """Factory: another gateway over the same in-process engine client, with other settings."""
    from hyrax.api.app import GatewaySettings, create_app

    started = []

    def make(**settings) -> str:
        settings.setdefault("admin_token", ADMIN_TOKEN)
        gw = Gateway(create_app(local_stack.client, GatewaySettings(**settings)))
        started.append(gw)
        return gw.url

    yield make
    for gw in started:
        gw.close()


@pytest.fixture
def oai(local):
    from openai import OpenAI

    with OpenAI(base_url=f"{local.url}/v1", api_key="any", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="session")
def ray_cluster():
    from hyrax.cluster.ray_cluster import init_ray

    started = init_ray(num_cpus=16, dashboard=False, num_gpus=0)
    import ray

    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_stack(ray_cluster):
    """One colocated TP=1 replica behind the gateway; alive for one module only, so it does
    not hold memory while tests/integration runs its own deployments."""
    from hyrax.api.app import GatewaySettings, create_app
    from hyrax.cluster.deployment import Deployment, RoleSpec
    from hyrax.cluster.ray_client import client_for

    dep = Deployment(DEMO_MODEL, [RoleSpec("colocated", 1, 1)], E2E_CONFIG)
    try:
        dep.start(timeout_s=300)
        client = RecordingClient(client_for(dep, MODEL))
        gw = Gateway(create_app(client, GatewaySettings(admin_token=ADMIN_TOKEN)))
        try:
            yield RayStack(gw.url, gw.server.config.app, client, dep)
        finally:
            gw.close()
    finally:
        dep.shutdown()
