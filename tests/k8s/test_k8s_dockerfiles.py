"""Static checks of docker/Dockerfile.cpu and docker/Dockerfile.cuda (no Docker daemon here):
base images, torch pins, install commands, non-root user, entrypoint, build context."""
from __future__ import annotations

import json
import re

import pytest
from k8s_helpers import REPO, gateway, raycluster

DOCKER = REPO / "docker"
# torch versions the `gpu` extra's pins require (vllm-flash-attn 2.6.2 declares torch==2.4.0)
GPU_EXTRA_TORCH = {"vllm-flash-attn==2.6.2": "2.4.0"}


def instructions(path):
    """[(INSTRUCTION, argument)], continuation lines joined, comments dropped."""
    out, buf = [], ""
    for line in path.read_text().splitlines():
        if not buf and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            buf += line.rstrip()[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.strip().partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    return out


def args_of(instr):
    return dict(a.split("=", 1) if "=" in a else (a, None) for k, a in instr if k == "ARG")


def runs(instr):
    return " ;; ".join(a for k, a in instr if k == "RUN")


@pytest.fixture(scope="module", params=["cpu", "cuda"])
def dockerfile(request):
    return request.param, instructions(DOCKER / f"Dockerfile.{request.param}")


def test_cpu_image_base_and_torch():
    instr = instructions(DOCKER / "Dockerfile.cpu")
    a = args_of(instr)
    assert a["PYTHON_IMAGE"] == "python:3.11-slim"
    assert ("FROM", "${PYTHON_IMAGE}") in instr
    pin = re.search(r"^torch==(\S+)", (REPO / "requirements-cpu.txt").read_text(), re.M)
    assert a["TORCH_VERSION"] == (pin[1] if pin else "2.13.0") == "2.13.0"
    assert "TORCH_INDEX_URL" in a, "the CPU wheel index is a build arg"
    r = runs(instr)
    assert 'pip install "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"' in r
    assert re.search(r"pip install \.(\s|$)", r), "installs the project: pip install ."
    assert r.index("torch==") < r.index("pip install ."), "torch first, so `pip install .` keeps the CPU build"


def test_cuda_image_base_and_torch():
    tomllib = pytest.importorskip("tomllib")
    instr = instructions(DOCKER / "Dockerfile.cuda")
    a = args_of(instr)
    assert re.fullmatch(r"nvidia/cuda:[\d.]+-(cudnn-)?runtime-ubuntu[\d.]+", a["CUDA_IMAGE"]), "a CUDA runtime base"
    assert ("FROM", "${CUDA_IMAGE}") in instr
    gpu_extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["gpu"]
    pins = [GPU_EXTRA_TORCH[p] for p in gpu_extra if p in GPU_EXTRA_TORCH]
    assert pins, f"gpu extra changed ({gpu_extra}): update TORCH_VERSION in docker/Dockerfile.cuda and this table"
    assert a["TORCH_VERSION"] == pins[0]
    assert "TORCH_INDEX_URL" in a
    r = runs(instr)
    assert "python3.11" in r, "the same Python as the CPU image"
    assert re.search(r'pip install "\.\[gpu\]"', r)
    assert r.index("torch==") < r.index('".[gpu]"')


def test_non_root_entrypoint_and_context(dockerfile):
    name, instr = dockerfile
    users = [a for k, a in instr if k == "USER"]
    assert users, f"{name}: no USER"
    uid = users[-1].split(":")[0].replace("${HYRAX_UID}", args_of(instr).get("HYRAX_UID") or "")
    assert uid not in ("", "0", "root"), f"{name}: must run as non-root"
    assert [k for k, _ in instr].index("USER") > max(i for i, (k, _) in enumerate(instr) if k == "RUN"), \
        f"{name}: USER after the last RUN (installs as root, runs as the user)"
    # the manifests run the pods as that same uid
    from k8s_helpers import KUSTOMIZATIONS, kustomize

    res = kustomize(KUSTOMIZATIONS["base"])
    specs = [gateway(res)["spec"]["template"]["spec"], raycluster(res)["spec"]["headGroupSpec"]["template"]["spec"],
             *(g["template"]["spec"] for g in raycluster(res)["spec"]["workerGroupSpecs"])]
    for spec in specs:
        assert str(spec["securityContext"]["runAsUser"]) == uid and spec["securityContext"]["runAsNonRoot"]

    entry = [a for k, a in instr if k == "ENTRYPOINT"]
    assert entry and json.loads(entry[-1]) == ["hyrax"], f"{name}: ENTRYPOINT [\"hyrax\"] (exec form)"
    tomllib = pytest.importorskip("tomllib")
    scripts = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts.get("hyrax") == "hyrax.cluster.cli:main"

    cmd = [a for k, a in instr if k == "CMD"]
    if cmd:
        from hyrax.cluster.cli import build_parser

        build_parser().parse_args(json.loads(cmd[-1]))

    for k, a in instr:
        if k == "COPY":
            *srcs, _dst = a.split()
            for s in srcs:
                assert (REPO / s).exists(), f"{name}: COPY source {s} missing from the repo root context"
    assert "wget" in runs(instr), f"{name}: KubeRay's default Ray probes use wget"


def test_dockerignore_keeps_what_the_build_copies(dockerfile):
    name, _ = dockerfile
    ignore = (DOCKER / f"Dockerfile.{name}.dockerignore").read_text().split()
    assert "**" in ignore
    for keep in ("!pyproject.toml", "!README.md", "!hyrax/"):
        assert keep in ignore
