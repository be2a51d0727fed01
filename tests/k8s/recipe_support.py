"""Running the shipped etcd recipe for real without a cluster: a kubectl stand-in for the API
server's Secrets, Secrets written out as the kubelet mounts them, and the StatefulSet's own etcd
command line moved to loopback ports (every TLS and auth flag kept as shipped)."""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

from k8s_support import container_env, expand, legacy_kubectl

# kubectl on the other side of launch/etcd-pki.sh's Kubernetes commands. Client-side verbs
# (create --dry-run=client) run the real kubectl; the API server's part (apply, get) keeps
# Secrets as JSON files in $FAKE_KUBE_DIR, as an API server would keep them.
FAKE_KUBECTL = """#!{python}
import base64, json, os, subprocess, sys
import yaml
store = os.environ["FAKE_KUBE_DIR"]
args = sys.argv[1:]
with open(os.path.join(store, "calls.log"), "a") as f:
    f.write(json.dumps(args) + "\\n")
if args[:1] == ["create"]:
    os.execv(os.environ["REAL_KUBECTL"], [os.environ["REAL_KUBECTL"], *args])
if args[:2] == ["apply", "-f"] and args[2] == "-":
    for doc in yaml.safe_load_all(sys.stdin):
        assert doc["kind"] == "Secret", doc["kind"]
        with open(os.path.join(store, doc["metadata"]["name"] + ".json"), "w") as f:
            json.dump(doc, f)
    sys.exit(0)
if args[:2] == ["get", "secret"]:
    path = os.path.join(store, args[2] + ".json")
    if not os.path.exists(path):
        print(f'Error from server (NotFound): secrets "{{args[2]}}" not found', file=sys.stderr)
        sys.exit(1)
    doc = json.load(open(path))
    out = args[args.index("-o") + 1]
    if out == "name":
        print("secret/" + args[2])
    elif out.startswith("jsonpath={{.data."):
        print(doc["data"].get(out[len("jsonpath={{.data."):-1], ""), end="")
    else:
        sys.exit(f"fake kubectl: -o {{out}} is not handled")
    sys.exit(0)
sys.exit(f"fake kubectl: {{args}} is not handled")
"""


def real_kubectl() -> str | None:
    """Any kubectl (its client-side verbs are the same from 1.20 on)."""
    return shutil.which("kubectl") or legacy_kubectl()


class FakeApiServer:
    """The Secrets a kubectl stand-in stored (under `root`), and its environment for scripts."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.kubectl = root / "kubectl"
        self.kubectl.write_text(FAKE_KUBECTL.format(python=sys.executable))
        self.kubectl.chmod(0o755)

    def env(self) -> dict[str, str]:
        return {"KUBECTL": str(self.kubectl), "FAKE_KUBE_DIR": str(self.root), "REAL_KUBECTL": real_kubectl() or ""}

    def secret(self, name: str) -> dict[str, bytes] | None:
        path = self.root / f"{name}.json"
        if not path.exists():
            return None
        doc = json.loads(path.read_text())
        return {k: base64.b64decode(v) for k, v in doc.get("data", {}).items()}

    def documents(self) -> list[dict]:
        return [json.loads(p.read_text()) for p in sorted(self.root.glob("*.json"))]

    def mount(self, volume: dict, target: Path) -> Path:
        """Write a pod volume (secret or projected secrets) as the kubelet would: one file per key."""
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir(parents=True)
        if "secret" in volume:
            sources = [{"secret": {"name": volume["secret"]["secretName"], **volume["secret"]}}]
            mode = volume["secret"].get("defaultMode", 0o644)
        else:
            sources = volume["projected"]["sources"]
            mode = volume["projected"].get("defaultMode", 0o644)
        for src in sources:
            name = src["secret"]["name"]
            data = self.secret(name)
            assert data is not None, f"volume {volume['name']}: Secret {name} does not exist"
            items = src["secret"].get("items") or [{"key": k, "path": k} for k in data]
            for item in items:
                assert item["key"] in data, f"Secret {name} has no key {item['key']}"
                path = target / item["path"]
                assert not path.exists(), f"volume {volume['name']}: two sources write {item['path']}"
                path.write_bytes(data[item["key"]])
                path.chmod(mode)
        return target


def etcd_member_argv(sts: dict, ordinal: int, ports: list[dict[int, int]], *, tls_dir: Path,
                     data_dir: Path, binary: str) -> list[str]:
    """The StatefulSet's etcd command for member `ordinal`, as its pod would run it, with only what
    places it moved here: each member's DNS name and 0.0.0.0 become 127.0.0.1, each container port its
    loopback port (ports[n]: container port -> port here), the TLS mount and the data directory temp
    directories. Every other flag is the shipped one."""
    c = sts["spec"]["template"]["spec"]["containers"][0]
    name = sts["metadata"]["name"]
    service = sts["spec"]["serviceName"]
    env = container_env(c, sts)
    env["POD_NAME"] = f"{name}-{ordinal}"
    mount = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}["tls"]

    def place(m: re.Match) -> str:
        host, port = m.group(2), int(m.group(3))
        if host == "0.0.0.0":
            member = ordinal
        else:
            hm = re.fullmatch(rf"{re.escape(name)}-(\d+)\.{re.escape(service)}(\..*)?", host)
            assert hm, f"etcd flag names {host}: not a member"
            member = int(hm.group(1))
        return f"{m.group(1)}://127.0.0.1:{ports[member][port]}"

    argv = [binary]
    for arg in c["args"]:
        arg = expand(str(arg), env)
        arg = re.sub(r"(https?)://([A-Za-z0-9.-]+):(\d+)", place, arg)
        arg = arg.replace(mount.rstrip("/") + "/", str(tls_dir) + "/")
        if arg.startswith("--data-dir="):
            arg = f"--data-dir={data_dir}"
        argv.append(arg)
    return argv


def run_script(cmd: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc
