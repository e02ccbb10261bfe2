"""Base vs overlays: each overlay changes exactly what it is for (the gpu overlay: GPU requests,
tolerations, node selectors, the CUDA image, monitoring and the TP 2 decode shape; cpu-dev: small
CPU pods), and nothing else."""
from __future__ import annotations

import copy

import pytest
from k8s_helpers import flag, gateway, gateway_argv, gateway_container, raycluster, worker_group

GPU = "nvidia.com/gpu"


def _all_containers(resources):
    rc = raycluster(resources)
    yield "head", rc["spec"]["headGroupSpec"]["template"]["spec"]
    for g in rc["spec"]["workerGroupSpecs"]:
        yield g["groupName"], g["template"]["spec"]
    yield "gateway", gateway(resources)["spec"]["template"]["spec"]


def test_cpu_dev_has_no_gpus_tolerations_or_node_selectors(rendered):
    for where, spec in _all_containers(rendered["cpu-dev"]):
        assert "tolerations" not in spec and "nodeSelector" not in spec, where
        for c in spec["containers"]:
            res = c.get("resources") or {}
            assert GPU not in (res.get("requests") or {}) and GPU not in (res.get("limits") or {}), where
            assert c["image"] == "hyrax:0.1.0", where
            assert c["imagePullPolicy"] == "IfNotPresent", where  # `kind load docker-image` images
    kinds = {r["kind"] for r in rendered["cpu-dev"]}
    assert not kinds & {"ServiceMonitor", "PodMonitor"}, "cpu-dev must apply on a cluster without Prometheus Operator"


def test_cpu_dev_fits_a_laptop(rendered):
    from k8s_helpers import quantity

    total_cpu = total_mem_gi = 0.0
    rc = raycluster(rendered["cpu-dev"])
    pods = [(1, rc["spec"]["headGroupSpec"]["template"]["spec"])]
    pods += [(g["replicas"], g["template"]["spec"]) for g in rc["spec"]["workerGroupSpecs"]]
    gw = gateway(rendered["cpu-dev"])
    pods += [(gw["spec"]["replicas"], gw["spec"]["template"]["spec"])]
    for n, spec in pods:
        req = spec["containers"][0]["resources"]["requests"]
        total_cpu += n * quantity(req["cpu"])
        assert req["memory"].endswith("Gi")
        total_mem_gi += n * float(req["memory"][:-2])
    opts = rc["spec"].get("autoscalerOptions", {}).get("resources", {}).get("requests", {})
    total_cpu += quantity(opts.get("cpu", 0))  # the autoscaler sidecar on the head pod
    total_mem_gi += quantity(opts.get("memory", "0Mi")[:-2]) / 1024 if opts.get("memory", "").endswith("Mi") else 0
    assert total_cpu <= 4 and total_mem_gi <= 11  # two gateways (issue 20) and the autoscaler included


def test_gpu_workers_request_gpus_with_tolerations_and_node_selectors(rendered):
    rc = raycluster(rendered["gpu"])
    for role in ("prefill", "decode"):
        spec = worker_group(rc, role)["template"]["spec"]
        res = spec["containers"][0]["resources"]
        assert int(res["requests"][GPU]) >= 1 and res["requests"][GPU] == res["limits"][GPU], role
        assert {"key": GPU, "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"], role
        assert spec["nodeSelector"] == {"nvidia.com/gpu.present": "true"}, role
    for where in ("head", "gateway"):
        spec = dict(_all_containers(rendered["gpu"]))[where]
        assert "tolerations" not in spec and "nodeSelector" not in spec, f"{where} belongs on CPU nodes"
        assert GPU not in str(spec["containers"][0].get("resources")), where


def test_gpu_uses_the_cuda_image_everywhere(rendered):
    images = {c["image"] for _, spec in _all_containers(rendered["gpu"]) for c in spec["containers"]}
    assert images == {"<your-registry>/hyrax-cuda:0.1.0"}, "one image (same Python and Ray) for every pod"


def test_gpu_includes_monitoring(rendered):
    kinds = {r["kind"] for r in rendered["gpu"]}
    assert {"ServiceMonitor", "PodMonitor", "ConfigMap"} <= kinds


def test_gpu_shape_is_tp2_decode(rendered):
    argv = gateway_argv(rendered["gpu"])
    assert flag(argv, "--decode-tp") == "2" and flag(argv, "--prefill-tp") == "1"
    assert flag(gateway_argv(rendered["base"]), "--decode-tp") == "1"


def _strip(resource, overlay_paths):
    r = copy.deepcopy(resource)
    r["metadata"].pop("namespace", None)
    for path in overlay_paths:
        node = r
        for p in path[:-1]:
            node = node[p]
        node.pop(path[-1], None)
    return r


def _images_to(res, image):
    out = copy.deepcopy(res)

    def walk(n):
        if isinstance(n, dict):
            for k, v in n.items():
                if k == "containers":
                    for c in v:
                        c["image"] = image
                walk(v)
        elif isinstance(n, list):
            for v in n:
                walk(v)
    walk(out)
    return out


@pytest.mark.parametrize("overlay", ["cpu-dev", "gpu"])
def test_overlays_change_only_what_they_mean_to(rendered, overlay):
    base = {(r["kind"], r["metadata"]["name"]): r for r in rendered["base"]}
    over = {(r["kind"], r["metadata"]["name"]): r for r in _images_to(rendered[overlay], "hyrax:0.1.0")}
    extra = set(over) - set(base)
    if overlay == "gpu":
        assert {k for k, _ in extra} == {"ServiceMonitor", "PodMonitor", "ConfigMap"}
    else:
        assert not extra
    assert set(base) <= set(over)

    worker = ["spec", "template", "spec"]
    rc_paths = [["spec", "headGroupSpec", "template", "spec", "containers", 0, "resources"]]
    for i, _ in enumerate(base[("RayCluster", "hyrax-raycluster")]["spec"]["workerGroupSpecs"]):
        g = ["spec", "workerGroupSpecs", i]
        rc_paths += [g + ["template", "spec", "containers", 0, "resources"], g + ["template", "spec", "nodeSelector"],
                     g + ["template", "spec", "tolerations"], g + ["maxReplicas"]]
    gw_paths = [worker + ["containers", 0, "resources"], worker + ["containers", 0, "args"]]
    allowed = {("RayCluster", "hyrax-raycluster"): rc_paths, ("Deployment", "hyrax-gateway"): gw_paths}
    for key, b in base.items():
        paths = allowed.get(key, [])
        assert _strip(over[key], paths) == _strip(b, paths), f"{overlay} changes {key} beyond {paths}"

    # and the parts it may change, it does change in the expected direction
    rc_b, rc_o = base[("RayCluster", "hyrax-raycluster")], over[("RayCluster", "hyrax-raycluster")]
    for role in ("prefill", "decode"):
        rb = worker_group(rc_b, role)["template"]["spec"]["containers"][0]["resources"]
        ro = worker_group(rc_o, role)["template"]["spec"]["containers"][0]["resources"]
        assert (GPU in ro["limits"]) == (overlay == "gpu") and GPU not in rb["limits"]
    c_over = gateway_container(rendered[overlay])
    c_base = gateway_container(rendered["base"])
    if overlay == "cpu-dev":
        assert c_over["args"] == c_base["args"]
