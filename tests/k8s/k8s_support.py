"""Helpers for the deployment tests: k8s/ files, kustomize binaries, schema validation,
Kubernetes $(VAR) expansion and the agent command lines found in pod specs."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any, Iterator

import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
LAUNCH = REPO / "launch"

# Oldest Kubernetes the manifests support: Job successPolicy (beta, on by default)
# and podFailurePolicy (GA) arrived in 1.31.
MIN_K8S = (1, 31)

# Where .ci/run may unpack Debian's kubernetes-client (kubectl 1.20, kustomize v2.0.3)
# when another package already owns /usr/bin/kubectl.
LEGACY_KUBECTL_PATHS = ("/opt/kubernetes-client-1.20/usr/bin/kubectl",)

# Stand-ins for what the API server and kubelet fill in through the downward API.
FAKE_NAMESPACE = "ml-team"
FAKE_POD_IP = "10.4.2.17"
FAKE_HOST_IP = "192.168.7.3"
FAKE_NODE = "gpu-node-3"
FAKE_UID = "3f1e2a4b-5c6d-4e7f-8a9b-0c1d2e3f4a5b"
# Labels the Job controller puts on every pod of a Job.
JOB_POD_LABELS = ("batch.kubernetes.io/job-name", "job-name", "batch.kubernetes.io/controller-uid",
                  "controller-uid", "batch.kubernetes.io/job-completion-index")


# ---- files -----------------------------------------------------------------------
def load_docs(path: Path) -> list[dict]:
    with open(path) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def kustomization_dirs() -> list[Path]:
    return sorted(p.parent for p in K8S.rglob("kustomization.yaml"))


def patch_files() -> set[Path]:
    """Files that kustomizations use as patches (partial objects, not resources)."""
    out: set[Path] = set()
    for d in kustomization_dirs():
        k = load_docs(d / "kustomization.yaml")[0]
        for p in k.get("patchesStrategicMerge") or []:
            out.add((d / p).resolve())
        for p in k.get("patchesJson6902") or []:
            out.add((d / p["path"]).resolve())
    return out


def resource_files() -> list[Path]:
    """Every YAML file under k8s/ that holds whole Kubernetes objects."""
    patches = patch_files()
    return sorted(
        p for p in K8S.rglob("*.yaml")
        if p.name != "kustomization.yaml" and p.resolve() not in patches
    )


def rel(p: Path) -> str:
    return str(p.relative_to(REPO))


# ---- kustomize -------------------------------------------------------------------
def _kubectl_minor(kubectl: str) -> int | None:
    try:
        out = subprocess.run([kubectl, "version", "--client", "-o", "json"], capture_output=True,
                             text=True, timeout=60).stdout
        return int(re.match(r"\d+", json.loads(out)["clientVersion"]["minor"]).group())
    except (OSError, ValueError, KeyError, AttributeError, subprocess.SubprocessError):
        return None


@functools.lru_cache(maxsize=None)
def current_kustomize() -> tuple[str, ...] | None:
    """A kustomize of this decade: `kustomize build` (v4/v5) or kubectl >= 1.21's."""
    path = shutil.which("kustomize")
    if path:
        return (path, "build")
    path = shutil.which("kubectl")
    if path and (_kubectl_minor(path) or 0) >= 21:
        return (path, "kustomize")
    return None


@functools.lru_cache(maxsize=None)
def legacy_kubectl() -> str | None:
    """kubectl 1.20 (Debian 12's kubernetes-client), whose kustomize is v2.0.3."""
    candidates = [os.environ.get("ELASTIC_RT_LEGACY_KUBECTL", ""), *LEGACY_KUBECTL_PATHS,
                  shutil.which("kubectl") or ""]
    for c in candidates:
        if c and os.access(c, os.X_OK) and _kubectl_minor(c) == 20:
            return c
    return None


def run_kustomize(cmd: tuple[str, ...], directory: Path) -> list[dict]:
    proc = subprocess.run([*cmd, str(directory)], capture_output=True, text=True, timeout=120)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} {rel(directory)} failed:\n{proc.stderr}")
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def key(doc: dict) -> tuple[str, str, str, str]:
    md = doc.get("metadata", {})
    return doc["apiVersion"], doc["kind"], md.get("namespace", ""), md["name"]


# ---- schemas ---------------------------------------------------------------------
def supported_versions() -> list[str]:
    from kubernetes_validate.utils import all_versions

    def mm(v: str) -> tuple[int, int]:
        a, b = v.split(".")[:2]
        return int(a), int(b)

    versions = sorted({".".join(v.split(".")[:2]) for v in all_versions()}, key=mm)
    return [v for v in versions if mm(v) >= MIN_K8S]


def validate_k8s(doc: dict, version: str) -> None:
    """Strict validation (unknown fields are errors) against that version's OpenAPI schema."""
    import kubernetes_validate

    kubernetes_validate.validate(doc, version, strict=True)


def is_builtin(doc: dict) -> bool:
    return "monitoring.coreos.com" not in doc["apiVersion"]


# ---- pods, env, command lines ----------------------------------------------------
def pod_template(doc: dict) -> dict | None:
    if doc["kind"] in ("Job", "StatefulSet", "Deployment", "DaemonSet", "ReplicaSet"):
        return doc["spec"]["template"]
    if doc["kind"] == "Pod":
        return doc
    return None


def fake_pod_meta(doc: dict) -> tuple[str, dict[str, str]]:
    """(pod name, labels) that a pod of this workload would get."""
    tmpl = pod_template(doc) or {}
    labels = dict(tmpl.get("metadata", {}).get("labels", {}))
    name = doc["metadata"]["name"]
    if doc["kind"] == "Job":
        labels.update({
            "batch.kubernetes.io/job-name": name, "job-name": name,
            "batch.kubernetes.io/controller-uid": FAKE_UID, "controller-uid": FAKE_UID,
            "batch.kubernetes.io/job-completion-index": "1",
        })
        return f"{name}-1-x7k2p", labels
    if doc["kind"] == "StatefulSet":
        return f"{name}-0", labels
    return f"{name}-5d9c7b8f6-x7k2p", labels


_REF = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.-]*)\)")


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: known names replaced, $$ -> $, unknown left as is."""
    def sub(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REF.sub(sub, text)


def field_value(path: str, doc: dict) -> str:
    pod_name, labels = fake_pod_meta(doc)
    fixed = {
        "metadata.name": pod_name, "metadata.namespace": FAKE_NAMESPACE, "metadata.uid": FAKE_UID,
        "status.podIP": FAKE_POD_IP, "status.hostIP": FAKE_HOST_IP, "spec.nodeName": FAKE_NODE,
        "spec.serviceAccountName": "default",
    }
    if path in fixed:
        return fixed[path]
    m = re.fullmatch(r"metadata\.labels\['([^']+)'\]", path)
    if m:
        if m.group(1) not in labels:
            raise AssertionError(f"fieldRef {path}: pods of {doc['kind']}/{doc['metadata']['name']} "
                                 "do not carry that label")
        return labels[m.group(1)]
    raise AssertionError(f"fieldRef {path} is not a field the tests know how to fill in")


def container_env(container: dict, doc: dict, configmaps: dict[str, dict] | None = None) -> dict[str, str]:
    """The environment the container starts with, expanded in list order as the kubelet does."""
    env: dict[str, str] = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = expand(str(item["value"]), env)
        elif "valueFrom" in item:
            src = item["valueFrom"]
            if "fieldRef" in src:
                env[item["name"]] = field_value(src["fieldRef"]["fieldPath"], doc)
            elif "configMapKeyRef" in src and configmaps is not None:
                ref = src["configMapKeyRef"]
                env[item["name"]] = configmaps[ref["name"]]["data"][ref["key"]]
            else:
                env[item["name"]] = f"<{item['name']}>"
        else:
            env[item["name"]] = ""
    return env


def container_argv(container: dict, env: dict[str, str]) -> list[str]:
    return [expand(str(a), env) for a in [*container.get("command", []), *container.get("args", [])]]


def containers(doc: dict) -> Iterator[tuple[dict, dict]]:
    tmpl = pod_template(doc)
    if tmpl is None:
        return
    for c in tmpl["spec"].get("containers", []) + tmpl["spec"].get("initContainers", []):
        yield tmpl["spec"], c


def elastic_rt_launches(docs: list[dict]) -> Iterator[tuple[dict, dict, dict, list[str]]]:
    """(workload, pod spec, container, expanded argv) for each container that runs elastic-rt launch."""
    for doc in docs:
        for spec, c in containers(doc):
            argv = container_argv(c, container_env(c, doc))
            if argv[:2] == ["elastic-rt", "launch"]:
                yield doc, spec, c, argv


def parse_launch(argv: list[str]) -> tuple[Any, Any]:
    """Parse an `elastic-rt launch ...` argv with the real CLI; returns (args, AgentConfig).
    A bad flag makes the parser exit 2: reported as an assertion with its message."""
    import contextlib
    import io

    from elastic_rt.cli import build_parser
    from elastic_rt.launch_config import launch_config_from_args

    assert argv[0] == "elastic-rt", argv
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = build_parser().parse_args(argv[1:])
        except SystemExit as exc:
            raise AssertionError(f"elastic-rt rejects {argv[1:]}: exit {exc.code}: {err.getvalue().strip()}")
    return args, launch_config_from_args(args)


def check_rendezvous_conf(cfg) -> None:
    """Build what the launcher would hand torch and validate it without connecting to etcd. The
    password file lives on a Secret volume of the pod: a stand-in with a password is read instead
    (test_k8s_security checks that the path is on the right Secret)."""
    import tempfile

    from torch.distributed.elastic.rendezvous import RendezvousParameters

    from elastic_rt.rendezvous.registration import etcd_config_from_params, settings_from_params

    with tempfile.NamedTemporaryFile("w", suffix=".password") as pw:
        pw.write("stand-in\n")
        pw.flush()
        conf = dict(cfg.conf, **({"password_file": pw.name} if "password_file" in cfg.conf else {}))
        params = RendezvousParameters(
            backend=cfg.rdzv_backend, endpoint=cfg.rdzv_endpoint, run_id=cfg.rdzv_id,
            min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes, local_addr=cfg.local_addr, **conf,
        )
        settings_from_params(params)
        config = etcd_config_from_params(params, "node-a")
    assert config.user is None or config.password == "stand-in", "the password must come from password_file"


def all_rendered() -> dict[str, list[dict]]:
    """Every kustomization rendered by the current kustomize (empty when there is none)."""
    tool = current_kustomize()
    if tool is None:
        return {}
    return {rel(d): run_kustomize(tool, d) for d in kustomization_dirs()}


@functools.lru_cache(maxsize=None)
def rendered_cached() -> dict[str, list[dict]]:
    return all_rendered()
