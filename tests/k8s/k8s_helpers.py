"""Shared helpers for the Kubernetes manifest tests (tests/k8s)."""
from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
SCHEMA_DIR = Path(__file__).resolve().parents[2].parent / "shared" / "k8s-schemas"
DASHBOARD = REPO / "dashboards" / "hyrax-grafana.json"
DASHBOARD_COPY = K8S / "monitoring" / "dashboards" / "hyrax-grafana.json"
KUSTOMIZATIONS = {"base": K8S / "base", "monitoring": K8S / "monitoring",
                  "cpu-dev": K8S / "overlays" / "cpu-dev", "gpu": K8S / "overlays" / "gpu"}
OVERLAYS = ("cpu-dev", "gpu")
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayService": "ray.io_rayservices.yaml"}
ROLES = ("prefill", "decode")


def kustomize(path) -> list[dict]:
    exe = shutil.which("kubectl")
    if exe is None:
        pytest.skip("kubectl is not installed: the manifests are rendered with `kubectl kustomize`")
    out = subprocess.run([exe, "kustomize", str(path)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, f"kubectl kustomize {path} failed: {out.stderr}"
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def one(resources: list[dict], kind: str, name: str | None = None) -> dict:
    hits = [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]
    assert len(hits) == 1, f"expected exactly one {kind} {name or ''}, found {len(hits)}"
    return hits[0]


def gateway(resources: list[dict]) -> dict:
    return one(resources, "Deployment", "hyrax-gateway")


def gateway_container(resources: list[dict]) -> dict:
    containers = gateway(resources)["spec"]["template"]["spec"]["containers"]
    return next(c for c in containers if c["name"] == "gateway")


def raycluster(resources: list[dict]) -> dict:
    return one(resources, "RayCluster")


def worker_group(rc: dict, name: str) -> dict:
    hits = [g for g in rc["spec"]["workerGroupSpecs"] if g["groupName"] == name]
    assert len(hits) == 1, f"RayCluster needs exactly one worker group {name!r}"
    return hits[0]


# ---- Kubernetes `$(VAR)` expansion in command/args ------------------------------------------

VAR_REF = re.compile(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def env_for_expansion(container: dict) -> dict[str, str]:
    """Literal env values as-is; values from Secrets/ConfigMaps as stand-in strings."""
    out = {}
    for e in container.get("env") or []:
        if "value" in e:
            out[e["name"]] = str(e["value"])
        elif "valueFrom" in e:
            out[e["name"]] = f"<{e['name'].lower()} from {next(iter(e['valueFrom']))}>"
    return out


def expand(args: list[str], env: dict[str, str]) -> list[str]:
    """Kubernetes semantics: $(VAR) is replaced when VAR is defined, `$$` escapes. Undefined
    references stay verbatim in a real pod; here they are an error."""
    def sub(m):
        assert m[1] in env, f"$({m[1]}) is not defined in the container's env"
        return env[m[1]]
    return [VAR_REF.sub(sub, a.replace("$$", "\0")).replace("\0", "$") for a in args]


def gateway_argv(resources: list[dict]) -> list[str]:
    """The `hyrax` argv the gateway container runs, after Kubernetes' $(VAR) expansion."""
    c = gateway_container(resources)
    return expand([str(a) for a in c["args"]], env_for_expansion(c))


def flag(argv: list[str], name: str) -> str | None:
    for i, a in enumerate(argv):
        if a == name and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None


# ---- resources as Ray sees them -------------------------------------------------------------

def quantity(q) -> float:
    """CPU / count quantities: '2', 2, '500m', '1.5'."""
    s = str(q)
    return int(s[:-1]) / 1000 if s.endswith("m") else float(s)


def ray_container(group: dict) -> dict:
    containers = group["template"]["spec"]["containers"]
    return next((c for c in containers if any(e.get("name") == "RAY" and e.get("value") == "true"
                                              for e in c.get("env") or [])), containers[0])


def ray_cpus(group: dict) -> int:
    """CPUs a KubeRay pod advertises to Ray: rayStartParams num-cpus, else the container's CPU
    limit (else request), rounded down as Ray rounds logical CPUs."""
    params = group.get("rayStartParams") or {}
    if "num-cpus" in params:
        return int(params["num-cpus"])
    res = ray_container(group).get("resources") or {}
    q = (res.get("limits") or {}).get("cpu", (res.get("requests") or {}).get("cpu", 0))
    return math.floor(quantity(q))


def ray_gpus(group: dict) -> int:
    params = group.get("rayStartParams") or {}
    if "num-gpus" in params:
        return int(params["num-gpus"])
    res = ray_container(group).get("resources") or {}
    q = (res.get("limits") or {}).get("nvidia.com/gpu", (res.get("requests") or {}).get("nvidia.com/gpu", 0))
    return int(quantity(q))


def cpu_request(group: dict) -> float:
    res = ray_container(group).get("resources") or {}
    return quantity((res.get("requests") or {}).get("cpu", 0))


def custom_resources(group: dict) -> dict:
    """rayStartParams `resources` is shell-quoted JSON ('"{\\"hyrax_prefill\\": 100}"')."""
    raw = (group.get("rayStartParams") or {}).get("resources")
    if raw is None:
        return {}
    words = shlex.split(raw)
    assert len(words) == 1, f"rayStartParams resources must be one shell word: {raw!r}"
    return json.loads(words[0])


def load_yaml_docs(path: Path) -> list:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
