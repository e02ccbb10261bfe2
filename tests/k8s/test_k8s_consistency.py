"""The manifests agree with the code they deploy: probe paths and ports are real gateway routes,
the gateway's container args are a `hyrax serve` invocation the CLI accepts (and validates),
secrets come from Secrets, the Grafana ConfigMap is dashboards/hyrax-grafana.json byte for byte,
and every worker group has room for its role's replicas x TP ranks."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
from k8s_helpers import (DASHBOARD, DASHBOARD_COPY, OVERLAYS, REPO, ROLES, cpu_request, custom_resources,
                         env_for_expansion, flag, gateway, gateway_argv, gateway_container, one, ray_container,
                         ray_cpus, ray_gpus, raycluster, worker_group)


class _DummyClient:
    """Enough of an engine client for create_app and its /health route."""

    model = None

    def __init__(self, ready: bool = True):
        self.ready = ready

    async def health(self):
        from hyrax.api.health import HealthReport

        return HealthReport((), None if self.ready else "no replica accepts requests")


def _app(ready: bool = True):
    from hyrax.api.app import GatewaySettings, create_app

    return create_app(_DummyClient(ready), GatewaySettings(admin_token="test-token"))


@pytest.fixture(scope="module")
def routes() -> dict[str, set[str]]:
    """path -> methods the gateway serves: the OpenAPI paths (routers included by the app) plus
    the routes registered on the app itself."""
    app = _app()
    out: dict[str, set[str]] = {p: {m.upper() for m in ops} for p, ops in app.openapi()["paths"].items()}
    for r in app.routes:
        if hasattr(r, "path"):
            out.setdefault(r.path, set()).update(getattr(r, "methods", None) or set())
    return out


def test_health_answers_200_when_ready_and_503_when_not():
    """What the probes rely on (TestClient without `with`: the lifespan's watcher does not run)."""
    from fastapi.testclient import TestClient

    assert TestClient(_app(ready=True)).get("/health").status_code == 200
    assert TestClient(_app(ready=False)).get("/health").status_code == 503


@pytest.fixture(scope="module")
def parser():
    from hyrax.cluster.cli import build_parser

    return build_parser()


def _named_port(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    hits = [p["containerPort"] for p in container.get("ports") or [] if p.get("name") == port]
    assert hits, f"container {container['name']} has no port named {port!r}"
    return hits[0]


# ---- probes, ports, routes ------------------------------------------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_probes_hit_real_routes_on_the_api_port(rendered, routes, overlay):
    c = gateway_container(rendered[overlay])
    api_port = int(flag(gateway_argv(rendered[overlay]), "--port"))
    probes = {k: c.get(k) for k in ("startupProbe", "readinessProbe", "livenessProbe")}
    assert probes["readinessProbe"] and probes["livenessProbe"], "gateway needs readiness and liveness probes"
    for kind, probe in probes.items():
        if probe is None:
            continue
        get = probe["httpGet"]
        assert get["path"] == "/health", kind
        assert get["path"] in routes and "GET" in routes[get["path"]], f"{kind}: no GET {get['path']} route"
        assert _named_port(c, get["port"]) == api_port == 8000, kind


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_service_exposes_the_api_port(rendered, overlay):
    svc = one(rendered[overlay], "Service", "hyrax-gateway")
    dep = gateway(rendered[overlay])
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"].items() <= pod_labels.items(), "Service selector must match the gateway pods"
    assert dep["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    (port,) = [p for p in svc["spec"]["ports"] if p["name"] == "http"]
    assert port["port"] == 8000
    assert _named_port(gateway_container(rendered[overlay]), port["targetPort"]) == 8000


def test_monitors_scrape_real_endpoints(rendered, routes):
    res = rendered["gpu"]  # the overlay that includes ../../monitoring
    sm = one(res, "ServiceMonitor")
    svc = one(res, "Service", "hyrax-gateway")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    svc_ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in svc_ports
        assert ep.get("path", "/metrics") in routes, "the gateway has no /metrics route"

    pm = one(res, "PodMonitor")
    want = pm["spec"]["selector"]["matchLabels"].items()
    rc = raycluster(res)
    templates = [rc["spec"]["headGroupSpec"]["template"], *(g["template"] for g in rc["spec"]["workerGroupSpecs"]),
                 gateway(res)["spec"]["template"]]
    for t in templates:
        assert want <= t["metadata"]["labels"].items(), "PodMonitor must select every Ray node pod"
        ports = {p["name"]: p["containerPort"] for c in t["spec"]["containers"] for p in c.get("ports") or []}
        for ep in pm["spec"]["podMetricsEndpoints"]:
            assert ports.get(ep["port"]) == 8080, f"no Ray metrics port named {ep['port']!r}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ray_head_has_no_compute_and_exposes_dashboard_and_metrics(rendered, overlay):
    head = raycluster(rendered[overlay])["spec"]["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    assert ray_gpus(head) == 0
    ports = {p["name"]: p["containerPort"] for p in head["template"]["spec"]["containers"][0]["ports"]}
    assert ports["dashboard"] == 8265 and ports["metrics"] == 8080 and ports["gcs-server"] == 6379
    assert head["rayStartParams"].get("metrics-export-port", "8080") == "8080"
    for g in raycluster(rendered[overlay])["spec"]["workerGroupSpecs"]:
        assert g.get("rayStartParams", {}).get("metrics-export-port", "8080") == "8080"


# ---- the gateway command is a real `hyrax serve` invocation ---------------------------------

@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_command_execs_hyrax_with_the_args(rendered, overlay):
    c = gateway_container(rendered[overlay])
    cmd = c["command"]
    assert cmd[:2] == ["/bin/bash", "-c"] and cmd[3] == "hyrax", "bash -c SCRIPT hyrax: $0=hyrax, $@=args"
    script = cmd[2]
    assert script.rstrip().splitlines()[-1].strip() == 'exec hyrax "$@"'
    assert "ray start --address \"$RAY_GCS_ADDRESS\" --num-cpus 0 --num-gpus 0" in script
    assert not re.search(r"\$\([A-Za-z_]", script), "no $(...) in the script: Kubernetes would expand it"
    bash = shutil.which("bash")
    if bash:
        check = subprocess.run([bash, "-n", "-c", script], capture_output=True, text=True)
        assert check.returncode == 0, f"gateway script has a bash syntax error: {check.stderr}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_args_parse_with_the_hyrax_cli(rendered, parser, overlay):
    argv = gateway_argv(rendered[overlay])
    assert argv[0] == "serve"
    try:
        ns = parser.parse_args(argv)
    except SystemExit:
        pytest.fail(f"`hyrax {' '.join(argv)}` is rejected by the hyrax CLI (see stderr)")
    assert ns.command == "serve" and ns.func.__module__ == "hyrax.cluster.serve"
    assert ns.host == "0.0.0.0" and ns.port == 8000
    assert not ns.colocated
    assert ns.api_key == [] and ns.api_key_file is None  # the key comes from HYRAX_API_KEY alone


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_args_pass_serve_validation(rendered, parser, overlay):
    """What `hyrax serve` checks before starting Ray: engine options, model, TP split, port."""
    from hyrax.cluster.serve import validate

    ns = parser.parse_args(gateway_argv(rendered[overlay]))
    _config, _path, _cfg, roles, _name = validate(ns)
    assert [r.name for r in roles] == list(ROLES)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateway_joins_the_kuberay_head_service(rendered, overlay):
    res = rendered[overlay]
    rc = raycluster(res)
    head_ports = {p["name"]: p["containerPort"] for p in rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["ports"]}
    expected = f"{rc['metadata']['name']}-head-svc:{head_ports['gcs-server']}"
    env = env_for_expansion(gateway_container(res))
    assert env["RAY_GCS_ADDRESS"] == expected
    assert flag(gateway_argv(res), "--address") == expected


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_tokens_come_from_secrets(rendered, overlay):
    c = gateway_container(rendered[overlay])
    env = {e["name"]: e for e in c["env"]}
    admin = env["HYRAX_ADMIN_TOKEN"]
    assert "value" not in admin
    assert admin["valueFrom"]["secretKeyRef"] == {"name": "hyrax-admin", "key": "token"}
    api = env["HYRAX_API_KEY"]
    assert "value" not in api
    assert api["valueFrom"]["secretKeyRef"]["name"] == "hyrax-api-keys"
    assert not api["valueFrom"]["secretKeyRef"].get("optional"), \
        "an optional key would leave /v1 open when the Secret lacks it"
    raw = [str(a) for a in c["args"]]
    # not `--api-key $(HYRAX_API_KEY)`: the key would be on the command line (`ps`), and with the
    # variable set too, hyrax serve refuses a key given two ways
    assert "--api-key" not in raw and "--api-key-file" not in raw
    assert "--admin-token-file" not in raw
    from hyrax.env import admin_token, api_key  # the server reads the tokens from these variables

    assert admin_token.__doc__.startswith("HYRAX_ADMIN_TOKEN")
    assert api_key.__doc__.startswith("HYRAX_API_KEY")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gateways_attach_to_one_named_deployment_and_roll_one_at_a_time(rendered, parser, overlay):
    """Engines outlive gateways: at least two gateways serve one deployment (by name), rolled
    with a new one ready before an old one stops, and never both evicted at once."""
    dep = gateway(rendered[overlay])
    assert dep["spec"]["replicas"] >= 2
    assert dep["spec"]["strategy"]["type"] == "RollingUpdate"
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    ns = parser.parse_args(gateway_argv(rendered[overlay]))
    assert ns.attach and ns.deployment == "hyrax", "every gateway must attach: without --attach the second one fails"
    pdb = one(rendered[overlay], "PodDisruptionBudget", "hyrax-gateway")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == dep["spec"]["selector"]["matchLabels"]


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_raycluster_autoscales_within_the_pods_the_replicas_need(rendered, overlay):
    """In-tree autoscaling on; each worker group's bounds are the pods its role's replicas need
    (whole replicas per pod) at --min-replicas and --max-replicas (fixed roles: their count)."""
    res = rendered[overlay]
    rc = raycluster(res)
    assert rc["spec"]["enableInTreeAutoscaling"] is True
    assert rc["spec"]["autoscalerOptions"]["idleTimeoutSeconds"] > 0
    gpu_cluster = any(ray_gpus(g) for g in rc["spec"]["workerGroupSpecs"])
    argv = gateway_argv(res)
    for role, (replicas, tp) in _shape(argv).items():
        g = worker_group(rc, role)
        per_pod = ray_cpus(g) // tp if not gpu_cluster else min(ray_cpus(g) // tp, ray_gpus(g) // tp)
        lo, hi = replicas, replicas
        if role == ROLES[-1] and flag(argv, "--max-replicas"):  # the decode role autoscales
            lo, hi = int(flag(argv, "--min-replicas")), int(flag(argv, "--max-replicas"))
        pods = (-(-lo // per_pod), -(-hi // per_pod))
        assert (g["minReplicas"], g["maxReplicas"]) == pods, f"{overlay} {role}: bounds != {pods} pods"


# ---- Grafana dashboard ----------------------------------------------------------------------

def test_grafana_configmap_is_the_dashboard_byte_for_byte(rendered):
    assert DASHBOARD.is_file(), "dashboards/hyrax-grafana.json is missing"
    cm = one(rendered["gpu"], "ConfigMap", "hyrax-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert list(cm["data"]) == ["hyrax-grafana.json"]
    source = DASHBOARD.read_bytes()
    assert DASHBOARD_COPY.read_bytes() == source, (
        "k8s/monitoring/dashboards/hyrax-grafana.json is stale: "
        "cp dashboards/hyrax-grafana.json k8s/monitoring/dashboards/hyrax-grafana.json")
    assert cm["data"]["hyrax-grafana.json"].encode("utf-8") == source
    dash = json.loads(source)
    assert dash.get("title") and isinstance(dash.get("panels"), list)


# ---- capacity: every role's replicas x TP ranks fit its worker group -----------------------

def _shape(argv: list[str]) -> dict[str, tuple[int, int]]:
    """role -> (replicas, tp) as `hyrax serve` derives them (defaults: 1 and 1)."""
    return {role: (int(flag(argv, f"--{role}-replicas") or 1), int(flag(argv, f"--{role}-tp") or 1))
            for role in ROLES}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_worker_groups_fit_their_roles(rendered, overlay):
    res = rendered[overlay]
    rc = raycluster(res)
    shape = _shape(gateway_argv(res))
    gpu_cluster = any(ray_gpus(g) for g in rc["spec"]["workerGroupSpecs"])
    need_cpu = need_gpu = have_cpu = have_gpu = 0
    for role, (replicas, tp) in shape.items():
        g = worker_group(rc, role)
        pods = g["replicas"]
        assert g["minReplicas"] <= pods <= g["maxReplicas"]
        # one replica's TP ranks are one placement group (PACK): a pod holds a whole replica
        assert cpu_request(g) >= tp, f"{role}: cpu request per worker < tp={tp}"
        assert ray_cpus(g) >= tp, f"{role}: Ray CPUs per worker < tp={tp}"
        assert pods * (ray_cpus(g) // tp) >= replicas, f"{role}: {replicas} x tp {tp} does not fit {pods} pods"
        assert replicas * tp <= pods * ray_cpus(g)
        if gpu_cluster:  # then every rank also takes one GPU
            assert ray_gpus(g) >= tp, f"{role}: GPUs per worker < tp={tp}"
            assert pods * (ray_gpus(g) // tp) >= replicas
            assert replicas * tp <= pods * ray_gpus(g)
        need_cpu += replicas * tp
        need_gpu += replicas * tp if gpu_cluster else 0
        have_cpu += pods * ray_cpus(g)
        have_gpu += pods * ray_gpus(g)
        assert custom_resources(g) == {f"hyrax_{role}": 100}, f"{role}: custom resource for role pinning"
    assert need_cpu <= have_cpu and need_gpu <= have_gpu
    # the head and the gateway's Ray node take no ranks
    assert ray_cpus(rc["spec"]["headGroupSpec"]) == 0


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cpu_and_gpu_requests_equal_limits_on_workers(rendered, overlay):
    """Ray counts limits; the scheduler counts requests: they must agree."""
    for g in raycluster(rendered[overlay])["spec"]["workerGroupSpecs"]:
        res = g["template"]["spec"]["containers"][0]["resources"]
        for k in ("cpu", "memory", "nvidia.com/gpu"):
            assert res["requests"].get(k) == res["limits"].get(k), f"{g['groupName']}: {k}"


def test_docs_admin_calls_hit_real_routes(routes):
    doc = (REPO / "docs" / "deploy.md").read_text()
    paths = set(re.findall(r"localhost:8000(/[A-Za-z0-9_/.-]+)", doc))
    assert {"/admin/retract", "/admin/drain", "/health"} <= paths
    for p in paths:
        assert p in routes, f"docs/deploy.md calls {p}, which the gateway does not serve"


# ---- shared memory: NCCL and Ray's object store need more than the runtime's 64 MiB ---------

@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_every_ray_pod_mounts_memory_backed_dev_shm(rendered, overlay):
    rc = raycluster(rendered[overlay])
    groups = {"head": rc["spec"]["headGroupSpec"], **{g["groupName"]: g for g in rc["spec"]["workerGroupSpecs"]}}
    assert set(groups) == {"head", *ROLES}
    for name, group in groups.items():
        pod = group["template"]["spec"]
        mounts = {m["mountPath"]: m["name"] for m in ray_container(group).get("volumeMounts") or []}
        assert "/dev/shm" in mounts, f"{overlay} {name}: no volume at /dev/shm"
        volume = next((v for v in pod.get("volumes") or [] if v["name"] == mounts["/dev/shm"]), None)
        assert volume is not None, f"{overlay} {name}: /dev/shm mounts a volume the pod does not declare"
        assert volume.get("emptyDir", {}).get("medium") == "Memory", f"{overlay} {name}: /dev/shm is not tmpfs"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_pod_outlives_the_gateways_shutdown(rendered, parser, overlay):
    """Kubernetes kills the gateway terminationGracePeriodSeconds after SIGTERM. The gateway
    lets streams run --grace-period seconds, then aborts those still open and waits up to
    END_WAIT_S for their last chunks: a pod killed before that cuts streams mid-body."""
    from hyrax.cluster.gateway_server import END_WAIT_S

    ns = parser.parse_args(gateway_argv(rendered[overlay]))
    pod = gateway(rendered[overlay])["spec"]["template"]["spec"]
    assert pod["terminationGracePeriodSeconds"] >= ns.grace_period + END_WAIT_S + 2, (pod, ns.grace_period)
