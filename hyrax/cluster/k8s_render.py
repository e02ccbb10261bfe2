"""A small, offline stand-in for `kustomize build` covering exactly the features the manifests
under k8s/ use, so tests can render the overlays without the kustomize binary.

Supported kustomization fields: `resources` (files, and directories holding a kustomization),
`patches` (inline `patch:` or `path:`; a YAML list is an RFC 6902 JSON patch and needs a
`target`, a mapping is a strategic-merge patch), `namespace`, `labels` (metadata only:
`includeSelectors`/`includeTemplates` must be false), `configMapGenerator` (`files`, `literals`,
`options.labels`/`annotations`, with `disableNameSuffixHash: true`), `generatorOptions` and
`images`. Anything else raises K8sRenderError rather than rendering something that `kubectl
apply -k` would not.

Strategic merge follows kustomize for the kinds used here: mappings merge recursively, `null`
deletes a key, lists of mappings that all carry `name` merge by `name` (patch elements first,
then the untouched originals, as kustomize orders them), any other list is replaced. Custom
resources (RayCluster, ...) have no merge keys in kustomize, so their lists are replaced; patch
them with JSON patches instead.

    python -m hyrax.cluster.k8s_render k8s/overlays/cpu-dev   # print the rendered YAML
"""
from __future__ import annotations

import copy
import re
import sys
from pathlib import Path

import yaml

KUSTOMIZATION_FILES = ("kustomization.yaml", "kustomization.yml", "Kustomization")
SUPPORTED_FIELDS = {"apiVersion", "kind", "resources", "patches", "namespace", "labels",
                    "configMapGenerator", "generatorOptions", "images"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass", "IngressClass", "RuntimeClass",
                  "MutatingWebhookConfiguration", "ValidatingWebhookConfiguration", "APIService"}
# kinds whose CRD-less strategic merge kustomize performs with Kubernetes' merge keys
BUILTIN_GROUPS = {"", "apps", "batch", "policy", "networking.k8s.io", "autoscaling", "rbac.authorization.k8s.io"}


class K8sRenderError(ValueError):
    pass


# ---- loading ---------------------------------------------------------------------------------

def _kustomization_file(d: Path) -> Path | None:
    for name in KUSTOMIZATION_FILES:
        if (d / name).is_file():
            return d / name
    return None


def _inside(root: Path, path: Path, what: str) -> Path:
    """kustomize's default load restrictor: files must lie in or below the kustomization root."""
    real = path.resolve()
    if real != root.resolve() and root.resolve() not in real.parents:
        raise K8sRenderError(f"{what} {path} is not in or below the kustomization root {root}")
    return real


def _yaml(text: str, where: str):
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise K8sRenderError(f"{where}: not valid YAML: {e}") from None


def load_documents(text: str, where: str = "") -> list[dict]:
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise K8sRenderError(f"{where}: not valid YAML: {e}") from None
    for d in docs:
        if not isinstance(d, dict) or "kind" not in d or "apiVersion" not in d:
            raise K8sRenderError(f"{where}: every document needs apiVersion and kind")
    return docs


def gvk(res: dict) -> tuple[str, str, str]:
    group, _, version = res["apiVersion"].rpartition("/")
    return group, version, res["kind"]


def res_id(res: dict) -> tuple[str, str, str, str]:
    md = res.get("metadata") or {}
    return res["apiVersion"], res["kind"], md.get("namespace") or "", md.get("name") or ""


# ---- strategic merge ------------------------------------------------------------------------

def strategic_merge(base, patch, builtin: bool = True):
    if isinstance(patch, dict) and isinstance(base, dict):
        if any(str(k).startswith("$") for k in patch):
            raise K8sRenderError("strategic-merge directives ($patch, $setElementOrder, ...) are not supported")
        out = dict(base)
        for k, v in patch.items():
            if v is None:
                out.pop(k, None)
            elif k in out:
                out[k] = strategic_merge(out[k], v, builtin)
            else:
                out[k] = copy.deepcopy(v)
        return out
    if (builtin and isinstance(patch, list) and isinstance(base, list) and patch and base
            and all(isinstance(e, dict) and "name" in e for e in patch + base)):
        originals = {e["name"]: e for e in base}
        merged = [strategic_merge(originals[e["name"]], e, builtin) if e["name"] in originals else copy.deepcopy(e)
                  for e in patch]
        patched = {e["name"] for e in patch}
        return merged + [copy.deepcopy(e) for e in base if e["name"] not in patched]
    return copy.deepcopy(patch)


# ---- JSON patch (RFC 6902) ------------------------------------------------------------------

def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise K8sRenderError(f"JSON pointer must start with '/': {path!r}")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _walk(doc, parts: list[str]):
    cur = doc
    for p in parts:
        if isinstance(cur, list):
            if not p.isdigit() or int(p) >= len(cur):
                raise K8sRenderError(f"no list index {p!r}")
            cur = cur[int(p)]
        elif isinstance(cur, dict):
            if p not in cur:
                raise K8sRenderError(f"no key {p!r}")
            cur = cur[p]
        else:
            raise K8sRenderError(f"cannot descend into a scalar at {p!r}")
    return cur


def _add(doc, parts, value):
    if not parts:
        return value
    parent, last = _walk(doc, parts[:-1]), parts[-1]
    if isinstance(parent, list):
        if last == "-":
            parent.append(value)
        elif last.isdigit() and int(last) <= len(parent):
            parent.insert(int(last), value)
        else:
            raise K8sRenderError(f"bad list index {last!r} for add")
    elif isinstance(parent, dict):
        parent[last] = value
    else:
        raise K8sRenderError("add into a scalar")
    return doc


def _remove(doc, parts):
    if not parts:
        raise K8sRenderError("cannot remove the whole document")
    parent, last = _walk(doc, parts[:-1]), parts[-1]
    _walk(parent, [last])  # must exist
    if isinstance(parent, list):
        return parent.pop(int(last))
    return parent.pop(last)


def json_patch(doc, ops: list[dict]):
    doc = copy.deepcopy(doc)
    for op in ops:
        kind, parts = op.get("op"), _pointer(op.get("path", ""))
        try:
            if kind == "add":
                doc = _add(doc, parts, copy.deepcopy(op["value"]))
            elif kind == "remove":
                _remove(doc, parts)
            elif kind == "replace":
                _walk(doc, parts)
                if not parts:
                    doc = copy.deepcopy(op["value"])
                else:
                    _remove(doc, parts)
                    doc = _add(doc, parts, copy.deepcopy(op["value"]))
            elif kind in ("move", "copy"):
                src = _pointer(op["from"])
                value = _remove(doc, src) if kind == "move" else copy.deepcopy(_walk(doc, src))
                doc = _add(doc, parts, value)
            elif kind == "test":
                if _walk(doc, parts) != op.get("value"):
                    raise K8sRenderError(f"test failed: {op['path']} != {op.get('value')!r}")
            else:
                raise K8sRenderError(f"unknown JSON patch op {kind!r}")
        except K8sRenderError as e:
            raise K8sRenderError(f"JSON patch {op}: {e}") from None
    return doc


# ---- transformers ---------------------------------------------------------------------------

def _matches(res: dict, target: dict) -> bool:
    unsupported = set(target) - {"group", "version", "kind", "name", "namespace"}
    if unsupported:
        raise K8sRenderError(f"patch target fields not supported: {sorted(unsupported)}")
    group, version, kind = gvk(res)
    md = res.get("metadata") or {}
    actual = {"group": group, "version": version, "kind": kind, "name": md.get("name", ""),
              "namespace": md.get("namespace", "")}
    return all(re.fullmatch(str(want), actual[k]) for k, want in target.items())


def _apply_patch(resources: list[dict], entry: dict, root: Path) -> list[dict]:
    extra = set(entry) - {"path", "patch", "target"}
    if extra:
        raise K8sRenderError(f"patch fields not supported: {sorted(extra)}")
    if ("path" in entry) == ("patch" in entry):
        raise K8sRenderError("a patch needs exactly one of path and patch")
    text = (_inside(root, root / entry["path"], "patch").read_text() if "path" in entry else entry["patch"])
    body = _yaml(text, "patch")
    target = entry.get("target")
    if isinstance(body, list):
        if not target:
            raise K8sRenderError("a JSON patch needs a target")
        hits = [i for i, r in enumerate(resources) if _matches(r, target)]
        if not hits:
            raise K8sRenderError(f"patch target {target} matches no resource")
        for i in hits:
            resources[i] = json_patch(resources[i], body)
        return resources
    if not isinstance(body, dict):
        raise K8sRenderError("a patch is a JSON patch list or a strategic-merge mapping")
    if target:
        hits = [i for i, r in enumerate(resources) if _matches(r, target)]
    else:
        want = (body.get("apiVersion"), body.get("kind"), (body.get("metadata") or {}).get("name"))
        hits = [i for i, r in enumerate(resources)
                if (r["apiVersion"], r["kind"], (r.get("metadata") or {}).get("name")) == want]
    if not hits:
        raise K8sRenderError(f"strategic-merge patch for {body.get('kind')}/"
                             f"{(body.get('metadata') or {}).get('name')} matches no resource")
    for i in hits:
        builtin = gvk(resources[i])[0] in BUILTIN_GROUPS
        merged = strategic_merge(resources[i], body, builtin)
        merged["metadata"]["name"] = resources[i]["metadata"]["name"]
        resources[i] = merged
    return resources


def _set_namespace(resources: list[dict], ns: str) -> None:
    for r in resources:
        if r["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            raise K8sRenderError("namespace rewriting of RBAC subjects is not supported")
        if r["kind"] not in CLUSTER_SCOPED:
            r.setdefault("metadata", {})["namespace"] = ns


def _add_labels(resources: list[dict], entries: list[dict]) -> None:
    for e in entries:
        extra = set(e) - {"pairs", "includeSelectors", "includeTemplates"}
        if extra or e.get("includeSelectors") or e.get("includeTemplates"):
            raise K8sRenderError("labels: only `pairs` (metadata labels) are supported")
        for r in resources:
            labels = r.setdefault("metadata", {}).setdefault("labels", {}) or {}
            labels.update({str(k): str(v) for k, v in (e.get("pairs") or {}).items()})
            r["metadata"]["labels"] = labels


_IMAGE_RE = re.compile(r"^(?P<name>[^@]+?)(?::(?P<tag>[^:/@]+))?(?:@(?P<digest>.+))?$")


def _rewrite_image(image: str, rules: list[dict]) -> str:
    m = _IMAGE_RE.match(image)
    if not m:
        return image
    name, tag, digest = m["name"], m["tag"], m["digest"]
    for rule in rules:
        if rule["name"] != name:
            continue
        new_name = rule.get("newName", name)
        if rule.get("digest"):
            return f"{new_name}@{rule['digest']}"
        if rule.get("newTag"):
            return f"{new_name}:{rule['newTag']}"
        return new_name + (f":{tag}" if tag else "") + (f"@{digest}" if digest else "")
    return image


def _set_images(node, rules: list[dict]) -> None:
    """Like kustomize: every `containers`/`initContainers` list anywhere in any resource."""
    if isinstance(node, dict):
        for k, v in node.items():
            if k in ("containers", "initContainers") and isinstance(v, list):
                for c in v:
                    if isinstance(c, dict) and isinstance(c.get("image"), str):
                        c["image"] = _rewrite_image(c["image"], rules)
            _set_images(v, rules)
    elif isinstance(node, list):
        for v in node:
            _set_images(v, rules)


# ---- generators -----------------------------------------------------------------------------

def _config_maps(k: dict, root: Path) -> list[dict]:
    out = []
    global_opts = k.get("generatorOptions") or {}
    for g in k.get("configMapGenerator") or []:
        extra = set(g) - {"name", "files", "literals", "options", "behavior"}
        if extra or g.get("behavior", "create") != "create":
            raise K8sRenderError(f"configMapGenerator: unsupported fields {sorted(extra)} or behavior")
        opts = {**global_opts, **(g.get("options") or {})}
        if not opts.get("disableNameSuffixHash"):
            raise K8sRenderError("configMapGenerator: name-suffix hashes are not supported; "
                                 "set options.disableNameSuffixHash: true")
        data = {}
        for f in g.get("files") or []:
            key, sep, rel = str(f).partition("=")
            rel = rel if sep else key
            key = key if sep else Path(rel).name
            data[key] = _inside(root, root / rel, "configMapGenerator file").read_bytes().decode("utf-8")
        for lit in g.get("literals") or []:
            key, sep, value = str(lit).partition("=")
            if not sep:
                raise K8sRenderError(f"literal {lit!r} needs KEY=VALUE")
            data[key] = value
        md = {"name": g["name"]}
        if opts.get("labels"):
            md["labels"] = {str(a): str(b) for a, b in opts["labels"].items()}
        if opts.get("annotations"):
            md["annotations"] = {str(a): str(b) for a, b in opts["annotations"].items()}
        out.append({"apiVersion": "v1", "kind": "ConfigMap", "metadata": md, "data": data})
    return out


# ---- build ----------------------------------------------------------------------------------

def render(path: str | Path, _stack: tuple = ()) -> list[dict]:
    """Render the kustomization in directory `path` into a list of resource dicts."""
    root = Path(path)
    kfile = _kustomization_file(root)
    if kfile is None:
        raise K8sRenderError(f"no kustomization file in {root}")
    if root.resolve() in _stack:
        raise K8sRenderError(f"kustomization cycle through {root}")
    k = _yaml(kfile.read_text(), str(kfile)) or {}
    unsupported = set(k) - SUPPORTED_FIELDS
    if unsupported:
        raise K8sRenderError(f"{kfile}: fields not supported by this renderer: {sorted(unsupported)}")
    if k.get("kind", "Kustomization") != "Kustomization":
        raise K8sRenderError(f"{kfile}: kind {k.get('kind')!r} is not supported")

    resources: list[dict] = []
    for ref in k.get("resources") or []:
        if "://" in str(ref) or str(ref).startswith("git@"):
            raise K8sRenderError(f"remote resource {ref!r} is not supported (offline renderer)")
        p = root / ref
        if p.is_dir():
            resources += render(p, _stack + (root.resolve(),))
        elif p.is_file():
            resources += load_documents(_inside(root, p, "resource").read_text(), str(p))
        else:
            raise K8sRenderError(f"{kfile}: resource {ref!r} does not exist")
    resources += _config_maps(k, root)

    seen = set()
    for r in resources:
        if res_id(r) in seen:
            raise K8sRenderError(f"duplicate resource {res_id(r)}")
        seen.add(res_id(r))

    for entry in k.get("patches") or []:
        resources = _apply_patch(resources, entry, root)
    if k.get("namespace"):
        _set_namespace(resources, k["namespace"])
    if k.get("labels"):
        _add_labels(resources, k["labels"])
    if k.get("images"):
        for rule in k["images"]:
            if set(rule) - {"name", "newName", "newTag", "digest"}:
                raise K8sRenderError(f"images: unsupported fields in {rule}")
        _set_images(resources, k["images"])
    return resources


def to_yaml(resources: list[dict]) -> str:
    return yaml.safe_dump_all(resources, sort_keys=True, default_flow_style=False)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m hyrax.cluster.k8s_render KUSTOMIZATION_DIR", file=sys.stderr)
        return 2
    try:
        sys.stdout.write(to_yaml(render(argv[0])))
    except (K8sRenderError, OSError) as e:
        print(f"k8s_render: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
