"""Fixtures for the Kubernetes manifest tests: every kustomization rendered once per session."""
from __future__ import annotations

import pytest
from k8s_helpers import KUSTOMIZATIONS

from hyrax.cluster.k8s_render import render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {name: render(path) for name, path in KUSTOMIZATIONS.items()}
