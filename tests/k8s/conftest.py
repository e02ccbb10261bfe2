"""Fixtures for the Kubernetes manifest tests: every kustomization rendered once per session by
`kubectl kustomize` (the kustomize built into kubectl), exactly what `kubectl apply -k` applies."""
from __future__ import annotations

import pytest
from k8s_helpers import KUSTOMIZATIONS, kustomize


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    return {name: kustomize(path) for name, path in KUSTOMIZATIONS.items()}
