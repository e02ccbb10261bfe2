"""Every manifest under k8s/ parses; the RayCluster validates against KubeRay's CRD schema and the
core kinds against Kubernetes' OpenAPI schemas (kubernetes-validate), both offline and strict
(unknown fields are errors, as with `kubectl apply --validate=strict`)."""
from __future__ import annotations

import copy
import json
import re

import pytest
import yaml
from k8s_helpers import (CRD_FILES, DASHBOARD_COPY, K8S, KUSTOMIZATIONS, OVERLAYS, REPO, SCHEMA_DIR,
                         load_yaml_docs, raycluster)

FAST_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # the CRD files are large
MANIFESTS = sorted(p for p in K8S.rglob("*") if p.suffix in (".yaml", ".yml"))


# ---- parsing --------------------------------------------------------------------------------

def test_manifest_files_exist():
    assert MANIFESTS, "no manifests under k8s/"
    for d in KUSTOMIZATIONS.values():
        assert (d / "kustomization.yaml").is_file(), d


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda p: str(p.relative_to(K8S)))
def test_every_manifest_parses(path):
    docs = load_yaml_docs(path)
    assert docs, f"{path} is empty"
    for d in docs:
        if isinstance(d, list):  # a JSON patch (RFC 6902) file used by a kustomization
            assert all(isinstance(op, dict) and {"op", "path"} <= set(op) for op in d), path
        else:
            assert isinstance(d, dict), path
            assert "kind" in d and ("apiVersion" in d or d["kind"] == "Kustomization"), path


def test_dashboard_copy_is_json():
    json.loads(DASHBOARD_COPY.read_text())


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_every_kustomization_renders(rendered, name):
    resources = rendered[name]
    assert resources
    ids = [(r["kind"], r["metadata"].get("namespace"), r["metadata"]["name"]) for r in resources]
    assert len(ids) == len(set(ids))
    for r in resources:
        assert r["metadata"]["labels"]["app.kubernetes.io/part-of"] == "hyrax", r["metadata"]["name"]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlays_set_a_namespace_and_no_secrets(rendered, overlay):
    for r in rendered[overlay]:
        assert r["metadata"].get("namespace") == "hyrax", r["metadata"]["name"]
        assert r["kind"] != "Secret", "secrets must be created out of band, never rendered from the repo"


def test_secret_example_is_not_in_any_kustomization():
    example = K8S / "secret.example.yaml"
    assert example.is_file()
    for kfile in K8S.rglob("kustomization.yaml"):
        k = yaml.safe_load(kfile.read_text())
        refs = [*(k.get("resources") or []), *(p.get("path", "") for p in k.get("patches") or [])]
        assert not any("secret" in str(ref) for ref in refs), f"{kfile} references a secret manifest"
    secrets = load_yaml_docs(example)
    assert {s["metadata"]["name"] for s in secrets} == {"hyrax-admin", "hyrax-api-keys"}
    for s in secrets:
        assert s["kind"] == "Secret"
        for v in (s.get("stringData") or {}).values():
            assert re.fullmatch(r"<[^>]+>", v), "secret.example.yaml must only hold <placeholders>"


# ---- KubeRay CRD schema ---------------------------------------------------------------------

def _strict(schema):
    """Forbid unknown properties wherever the schema lists properties (the API server prunes or,
    with strict field validation, rejects them): a typo in a field name then fails here."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if (schema.get("type") == "object" and "properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    return schema


@pytest.fixture(scope="module")
def crd_schemas():
    if not SCHEMA_DIR.is_dir():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMA_DIR} (shared/k8s-schemas beside the repo)")
    out = {}
    for kind, fname in CRD_FILES.items():
        crd = yaml.load((SCHEMA_DIR / fname).read_text(), Loader=FAST_LOADER)
        assert crd["kind"] == "CustomResourceDefinition" and crd["spec"]["names"]["kind"] == kind
        group = crd["spec"]["group"]
        for v in crd["spec"]["versions"]:
            out[(f"{group}/{v['name']}", kind)] = v["schema"]["openAPIV3Schema"]
    return out


def _crd_validate(resource, schemas, strict=True):
    jsonschema = pytest.importorskip("jsonschema")

    key = (resource["apiVersion"], resource["kind"])
    assert key in schemas, f"no CRD schema for {key}"
    schema = _strict(schemas[key]) if strict else schemas[key]
    jsonschema.Draft7Validator(schema).validate(resource)


@pytest.mark.parametrize("name", ["base", *OVERLAYS])
def test_ray_resources_validate_against_kuberay_crd(rendered, crd_schemas, name):
    ray = [r for r in rendered[name] if r["kind"] in CRD_FILES]
    assert ray, f"{name} has no RayCluster/RayService"
    for r in ray:
        assert r["apiVersion"] == "ray.io/v1"
        _crd_validate(r, crd_schemas, strict=False)
        _crd_validate(r, crd_schemas, strict=True)


def test_crd_validation_catches_mistakes(rendered, crd_schemas):
    jsonschema = pytest.importorskip("jsonschema")

    rc = raycluster(rendered["gpu"])
    typo = copy.deepcopy(rc)
    typo["spec"]["workerGroupSpecs"][0]["rayStartParam"] = typo["spec"]["workerGroupSpecs"][0].pop("rayStartParams")
    wrong_type = copy.deepcopy(rc)
    wrong_type["spec"]["headGroupSpec"]["rayStartParams"]["num-cpus"] = 0  # must be a string
    missing = copy.deepcopy(rc)
    del missing["spec"]["workerGroupSpecs"][1]["groupName"]
    for bad in (typo, wrong_type, missing):
        with pytest.raises(jsonschema.ValidationError):
            _crd_validate(bad, crd_schemas)


# ---- core kinds: kubernetes-validate (ships the OpenAPI schemas, works offline) -------------

@pytest.fixture(scope="module")
def kube_validate():
    kv = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate (dev extra)")
    from kubernetes_validate import utils

    return lambda r: kv.validate(r, utils.latest_version(), strict=True)


CORE_GROUPS = ("v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1", "autoscaling/v2")


@pytest.mark.parametrize("name", list(KUSTOMIZATIONS))
def test_core_kinds_validate(rendered, kube_validate, name):
    core = [r for r in rendered[name] if r["apiVersion"] in CORE_GROUPS]
    for r in core:
        kube_validate(r)
    for p in [K8S / "secret.example.yaml"]:
        for r in load_yaml_docs(p):
            kube_validate(r)


def test_core_validation_catches_mistakes(rendered, kube_validate):
    import kubernetes_validate

    dep = next(r for r in rendered["gpu"] if r["kind"] == "Deployment")
    typo = copy.deepcopy(dep)
    typo["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["httpGet"]["paht"] = "/health"
    wrong_type = copy.deepcopy(dep)
    wrong_type["spec"]["replicas"] = "one"
    for bad in (typo, wrong_type):
        with pytest.raises(kubernetes_validate.ValidationError):
            kube_validate(bad)


# ---- Prometheus Operator objects (no schema shipped: structural checks) ----------------------

def test_monitors_are_well_formed(rendered):
    mon = rendered["monitoring"]
    kinds = {r["kind"] for r in mon}
    assert {"ServiceMonitor", "PodMonitor", "ConfigMap"} <= kinds
    for r in mon:
        if r["kind"] == "ServiceMonitor":
            assert r["apiVersion"] == "monitoring.coreos.com/v1"
            assert r["spec"]["selector"]["matchLabels"]
            assert r["spec"]["endpoints"] and all("port" in e for e in r["spec"]["endpoints"])
        if r["kind"] == "PodMonitor":
            assert r["apiVersion"] == "monitoring.coreos.com/v1"
            assert r["spec"]["selector"]["matchLabels"]
            assert r["spec"]["podMetricsEndpoints"] and all("port" in e for e in r["spec"]["podMetricsEndpoints"])


# ---- nothing machine- or site-specific in what ships ----------------------------------------

SHIPPED = [*MANIFESTS, DASHBOARD_COPY.parent, REPO / "docker", REPO / "docs" / "deploy.md"]


def _shipped_files():
    for p in SHIPPED:
        if p.is_dir():
            yield from (f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            yield p


def test_no_hosts_paths_or_credentials_in_shipped_files():
    url = re.compile(r"\b[a-z][a-z0-9+.-]*://([^/\s\"'`<>)]+)")
    local_hosts = re.compile(r"^(localhost|127\.0\.0\.1|0\.0\.0\.0|\$[A-Za-z_{(]|<)")
    machine_path = re.compile(r"(?<![\w.])/(work|root|Users|mnt/c|tmp/bash_jobs)/")
    secretish = re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----|\bghp_[A-Za-z0-9]{20,}|\bAKIA[0-9A-Z]{16}\b"
                           r"|\bsk-[A-Za-z0-9]{20,}|(?i:password|passwd)\s*[:=]\s*\S+")
    files = list(_shipped_files())
    assert files
    for f in files:
        if f.name.endswith(".json"):
            continue  # the dashboard copy is checked byte for byte against dashboards/
        text = f.read_text()
        for m in url.finditer(text):
            assert local_hosts.match(m[1]), f"{f.relative_to(REPO)}: names a host: {m[0]}"
        assert not machine_path.search(text), f"{f.relative_to(REPO)}: names a machine path"
        assert not secretish.search(text), f"{f.relative_to(REPO)}: looks like a credential"
