"""hyrax.cluster.k8s_render: the kustomize subset the manifests use, and refusal of the rest."""
from __future__ import annotations

import textwrap

import pytest

from hyrax.cluster.k8s_render import (K8sRenderError, _rewrite_image, json_patch, main, render,
                                      strategic_merge)


def _write(d, name, text):
    p = d / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


DEPLOY = """\
    apiVersion: apps/v1
    kind: Deployment
    metadata: {name: web}
    spec:
      template:
        spec:
          containers:
            - name: a
              image: repo/app:1.0
              args: [x, y]
              env: [{name: A, value: "1"}, {name: B, value: "2"}]
            - name: b
              image: other:2
"""


def test_json_patch_ops():
    doc = {"a": [1, 2], "b": {"c": 1}}
    out = json_patch(doc, [{"op": "add", "path": "/a/-", "value": 3}, {"op": "add", "path": "/a/0", "value": 0},
                           {"op": "replace", "path": "/b/c", "value": 2}, {"op": "remove", "path": "/a/1"},
                           {"op": "copy", "from": "/b", "path": "/d"}, {"op": "move", "from": "/d/c", "path": "/e"},
                           {"op": "test", "path": "/e", "value": 2}, {"op": "add", "path": "/f~1g", "value": 1}])
    assert out == {"a": [0, 2, 3], "b": {"c": 2}, "d": {}, "e": 2, "f/g": 1}
    assert doc == {"a": [1, 2], "b": {"c": 1}}, "input untouched"
    for bad in ([{"op": "test", "path": "/b/c", "value": 9}], [{"op": "replace", "path": "/zz", "value": 1}],
                [{"op": "remove", "path": "/a/5"}], [{"op": "frobnicate", "path": "/a"}]):
        with pytest.raises(K8sRenderError):
            json_patch(doc, bad)


def test_strategic_merge_semantics():
    base = {"containers": [{"name": "a", "args": ["x"], "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]},
                           {"name": "b"}], "keep": 1, "drop": 2, "list": [1, 2]}
    patch = {"containers": [{"name": "a", "args": ["y"], "env": [{"name": "B", "value": "3"}]}],
             "drop": None, "list": [3]}
    out = strategic_merge(base, patch)
    assert out == {"containers": [{"name": "a", "args": ["y"], "env": [{"name": "B", "value": "3"}, {"name": "A", "value": "1"}]},
                                  {"name": "b"}], "keep": 1, "list": [3]}
    # custom resources: lists are replaced (kustomize has no merge keys for them)
    assert strategic_merge(base, {"containers": [{"name": "a"}]}, builtin=False)["containers"] == [{"name": "a"}]
    with pytest.raises(K8sRenderError):
        strategic_merge(base, {"$patch": "delete"})


@pytest.mark.parametrize("image, rule, want", [
    ("hyrax:0.1.0", {"name": "hyrax", "newName": "reg/hyrax-cuda"}, "reg/hyrax-cuda:0.1.0"),
    ("hyrax:0.1.0", {"name": "hyrax", "newTag": "0.2.0"}, "hyrax:0.2.0"),
    ("hyrax", {"name": "hyrax", "newName": "r/h", "newTag": "1"}, "r/h:1"),
    ("hyrax:0.1.0", {"name": "hyrax", "digest": "sha256:abc"}, "hyrax@sha256:abc"),
    ("host:5000/hyrax:1", {"name": "host:5000/hyrax", "newTag": "2"}, "host:5000/hyrax:2"),
    ("hyraxx:1", {"name": "hyrax", "newTag": "2"}, "hyraxx:1"),
])
def test_image_rewrites(image, rule, want):
    assert _rewrite_image(image, [rule]) == want


def test_full_build(tmp_path):
    base = tmp_path / "base"
    _write(base, "deploy.yaml", DEPLOY)
    _write(base, "files/conf.json", '{"k": 1}\n')
    _write(base, "kustomization.yaml", """\
        resources: [deploy.yaml]
        configMapGenerator:
          - name: conf
            files: [files/conf.json, renamed.json=files/conf.json]
            literals: [mode=fast]
            options: {disableNameSuffixHash: true, labels: {x: "1"}}
    """)
    ov = tmp_path / "ov"
    _write(ov, "patch.yaml", """\
        - op: replace
          path: /spec/template/spec/containers/1/image
          value: other:3
    """)
    _write(ov, "kustomization.yaml", """\
        namespace: ns
        resources: [../base]
        labels: [{pairs: {team: t}}]
        images: [{name: repo/app, newName: reg/app, newTag: "2.0"}]
        patches:
          - path: patch.yaml
            target: {kind: Deployment, name: w.b}
          - patch: |
              apiVersion: apps/v1
              kind: Deployment
              metadata: {name: web}
              spec:
                template:
                  spec:
                    containers: [{name: a, args: [z]}]
    """)
    out = {r["kind"]: r for r in render(ov)}
    dep, cm = out["Deployment"], out["ConfigMap"]
    assert dep["metadata"] == {"name": "web", "namespace": "ns", "labels": {"team": "t"}}
    a, b = dep["spec"]["template"]["spec"]["containers"]
    assert a["image"] == "reg/app:2.0" and a["args"] == ["z"] and len(a["env"]) == 2
    assert b["image"] == "other:3"
    assert cm["metadata"] == {"name": "conf", "namespace": "ns", "labels": {"x": "1", "team": "t"}}
    assert cm["data"] == {"conf.json": '{"k": 1}\n', "renamed.json": '{"k": 1}\n', "mode": "fast"}


REFUSED = {
    "unsupported field": "resources: [d.yaml]\ncommonLabels: {a: b}\n",
    "hash suffix": "resources: [d.yaml]\nconfigMapGenerator: [{name: c, files: [d.yaml]}]\n",
    "file outside the root": "resources: [d.yaml]\nconfigMapGenerator: "
                             "[{name: c, files: [../outside.json], options: {disableNameSuffixHash: true}}]\n",
    "remote resource": "resources: [https://example.invalid/x]\n",
    "missing resource": "resources: [missing.yaml]\n",
    "json patch without target": "resources: [d.yaml]\npatches: [{patch: '[{op: add, path: /x, value: 1}]'}]\n",
    "patch matching nothing": "resources: [d.yaml]\n"
                              "patches: [{patch: '{apiVersion: v1, kind: Service, metadata: {name: nope}}'}]\n",
    "patch is not YAML": "resources: [d.yaml]\npatches: [{patch: 'a: [b'}]\n",
    "selector labels": "resources: [d.yaml]\nlabels: [{pairs: {a: b}, includeSelectors: true}]\n",
}


@pytest.mark.parametrize("why", list(REFUSED))
def test_refuses_what_it_does_not_implement(tmp_path, why):
    _write(tmp_path, "outside.json", "{}")
    d = tmp_path / "k"
    _write(d, "d.yaml", DEPLOY)
    _write(d, "kustomization.yaml", REFUSED[why])
    with pytest.raises(K8sRenderError):
        render(d)


def test_cli(tmp_path, capsys):
    _write(tmp_path, "d.yaml", DEPLOY)
    _write(tmp_path, "kustomization.yaml", "resources: [d.yaml]\n")
    assert main([str(tmp_path)]) == 0
    assert "kind: Deployment" in capsys.readouterr().out
    assert main([str(tmp_path / "nope")]) == 1
    assert main([]) == 2
