"""The shipped Kubernetes etcd recipe, run for real: launch/etcd-pki.sh makes the CA, the certificates
and the users as the etcd-pki and etcd-user Jobs run it (a kubectl stand-in keeps their Secrets), three
etcd members start with the StatefulSet's own flags (TLS, client certificates, peer CN, JWT auth
tokens) on loopback, and a 2-node `elastic-rt launch` with the training Job's own command line and
mounted credentials trains through them. A stranger without a client certificate, and another job's
user, cannot write the job's keys. The etcd binary is the tests' (CI runs this file on etcd 3.4 too)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest

from k8s_support import FAKE_UID, K8S, LAUNCH, REPO, container_env, elastic_rt_launches, expand, load_docs
from recipe_support import FakeApiServer, etcd_member_argv, real_kubectl, run_script
from tests.support.tools import needs_tool

from etcd_testbed.server import find_etcd_binary, find_etcdctl, free_port, free_ports
from elastic_rt.errors import EtcdAccessError
from elastic_rt.rendezvous.etcd_client import EtcdClient
from elastic_rt.rendezvous.registration import etcd_config_from_conf

PKI_SH = LAUNCH / "etcd-pki.sh"
pytestmark = needs_tool("kubectl", real_kubectl() is not None,
                        "apt-get install kubernetes-client (its client-side verbs make the Secrets)")


def docs_of(*subdirs: str) -> list[dict]:
    return [d for sub in subdirs for p in sorted((K8S / sub).glob("*.yaml"))
            if p.name != "kustomization.yaml" for d in load_docs(p)]


def find(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    return doc


def script_argv(job: dict, pki_dir: Path) -> tuple[list[str], dict[str, str]]:
    """A Job's etcd-pki.sh command line and environment, with its --dir moved to pki_dir."""
    c = job["spec"]["template"]["spec"]["containers"][0]
    argv = [str(a) for a in c["command"] + c.get("args", [])]
    assert Path(argv[0]).name == PKI_SH.name, argv
    argv = [str(PKI_SH)] + [f"--dir={pki_dir}" if a.startswith("--dir=") else a for a in argv[1:]]
    return argv, container_env(c, job)


class Recipe:
    """Secrets, etcd members and credentials of one run of the recipe, in tmp."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.api = FakeApiServer(tmp / "api")
        self.docs = docs_of("etcd", "job")
        self.binary = find_etcd_binary()
        self.procs: list[subprocess.Popen] = []
        ports = iter(free_ports(9))
        self.ports = [{2379: next(ports), 2380: next(ports), 2381: next(ports)} for _ in range(3)]
        self.endpoints = ",".join(f"https://127.0.0.1:{p[2379]}" for p in self.ports)
        self.base_env = {**self.api.env(), "ETCDCTL_BIN": find_etcdctl(self.binary), "ETCD_WAIT_S": "90",
                         "ETCD_ENDPOINTS": self.endpoints}

    def start_members(self) -> None:
        sts = find(self.docs, "StatefulSet", "etcd")
        volumes = {v["name"]: v for v in sts["spec"]["template"]["spec"]["volumes"]}
        tls_dir = self.api.mount(volumes["tls"], self.tmp / "etcd-tls")
        help_text = subprocess.run([self.binary, "--help"], capture_output=True, text=True).stdout
        for i in range(3):
            argv = etcd_member_argv(sts, i, self.ports, tls_dir=tls_dir, data_dir=self.tmp / f"data-{i}",
                                    binary=self.binary)
            if "unsafe-no-fsync" in help_text:  # a loaded test machine; no bearing on security
                argv.append("--unsafe-no-fsync")
            log = open(self.tmp / f"etcd-{i}.log", "wb")
            self.procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def pki_job(self) -> None:
        """The etcd-pki Job: it stores the Secrets, the members start on etcd-tls, it enables auth."""
        argv, env = script_argv(find(self.docs, "Job", "etcd-pki"), self.tmp / "pki-work")
        env = {**env, "POD_NAMESPACE": "ml-team", **self.base_env}
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env={**os.environ, **env})
        deadline = time.monotonic() + 60
        while self.api.secret("etcd-tls") is None:
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "the etcd-pki Job stored no etcd-tls Secret"
            time.sleep(0.1)
        self.start_members()
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 0, out + self.etcd_logs()
        assert "auth enabled" in out, out

    def user_job(self, job_name: str) -> dict[str, bytes]:
        """The etcd-user Job of the training Job `job_name` (the shipped one, its name swapped in)."""
        job = find(self.docs, "Job", "elastic-rt-train-etcd-user")
        argv, env = script_argv(job, self.tmp / f"user-work-{uuid.uuid4().hex[:8]}")  # a fresh emptyDir
        argv = [job_name if a == "elastic-rt-train" else a for a in argv]
        volumes = {v["name"]: v for v in job["spec"]["template"]["spec"]["volumes"]}
        pki = self.api.mount(volumes["pki"], self.tmp / f"pki-secrets-{job_name}")
        assert env["PKI_SECRETS"] == [m["mountPath"] for m in job["spec"]["template"]["spec"]["containers"][0]
                                      ["volumeMounts"] if m["name"] == "pki"][0]
        run_script(argv, {**env, **self.base_env, "PKI_SECRETS": str(pki)})
        secret = self.api.secret(f"{job_name}-etcd")
        assert secret is not None
        return secret

    def credentials(self, job_name: str) -> tuple[Path, str]:
        """The training Job's credentials volume, mounted here; (directory, its mount path in the pod)."""
        job = find(self.docs, "Job", "elastic-rt-train")
        spec = job["spec"]["template"]["spec"]
        (mount,) = [m for m in spec["containers"][0]["volumeMounts"] if m["name"] == "etcd-credentials"]
        (volume,) = [v for v in spec["volumes"] if v["name"] == "etcd-credentials"]
        volume = {**volume, "secret": {**volume["secret"], "secretName": f"{job_name}-etcd"}}
        return self.api.mount(volume, self.tmp / f"creds-{job_name}"), mount["mountPath"]

    def etcd_logs(self) -> str:
        return "".join((self.tmp / f"etcd-{i}.log").read_text(errors="replace")[-2000:] for i in range(3)
                       if (self.tmp / f"etcd-{i}.log").exists())

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)


@pytest.fixture(scope="module")
def recipe(tmp_path_factory):
    r = Recipe(tmp_path_factory.mktemp("recipe"))
    try:
        r.pki_job()
        yield r
    finally:
        r.stop()


def agent_argv(recipe: Recipe, creds: Path, mount_path: str, run_id: str, node: str, log_dir: Path) -> list[str]:
    """The base Job's `elastic-rt launch` arguments as its pod would run them, with what places it moved
    here (etcd endpoints, address, ports, log dir, credentials directory, the script's path) and a short
    job: 2 nodes exactly, 5 steps."""
    (job, _spec, _c, argv), = elastic_rt_launches(recipe.docs)
    out = []
    for a in argv[2:]:
        flag = a.split("=", 1)[0]
        a = {"--rdzv-endpoint": f"--rdzv-endpoint={recipe.endpoints}", "--rdzv-id": f"--rdzv-id={run_id}",
             "--local-addr": "--local-addr=127.0.0.1", "--node-id": f"--node-id={node}",
             "--metrics-port": f"--metrics-port={free_port()}", "--log-dir": f"--log-dir={log_dir}",
             "--nnodes": "--nnodes=2:2", "--steps": "--steps=5"}.get(flag, a)
        if flag == "--rdzv-conf":
            a = a.replace(mount_path.rstrip("/") + "/", f"{creds}/")
        if a.startswith("/opt/elastic-rt/launch/"):
            a = str(LAUNCH / a[len("/opt/elastic-rt/launch/"):])
        out.append(a)
    return [sys.executable, "-m", "elastic_rt.cli", "launch", "--probe-bytes=0", *out]


def launch(argv: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "ELASTIC_RT_ETCD_PASSWORD"}
    env.update(PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=str(REPO),
                            env=env, start_new_session=True)


def finish(proc: subprocess.Popen, timeout_s: float) -> tuple[int, str]:
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        raise AssertionError(f"did not end within {timeout_s} s:\n{out[-4000:]}") from None
    return proc.returncode, out


@pytest.mark.slow
def test_the_recipe_trains_over_tls_and_auth_and_refuses_strangers(recipe, tmp_path):
    # the members' /health, which the StatefulSet's probes ask, is plain HTTP and healthy with auth on
    for p in recipe.ports:
        with urllib.request.urlopen(f"http://127.0.0.1:{p[2381]}/health?serializable=false", timeout=10) as r:
            assert b'"health":"true"' in r.read()
    first = recipe.user_job("elastic-rt-train")
    again = recipe.user_job("elastic-rt-train")  # a retried Job keeps what running agents hold
    assert again["password"] == first["password"] and again["client.pem"] == first["client.pem"]
    assert set(first) == {"ca.pem", "client.pem", "client.key", "password"}
    creds, mount_path = recipe.credentials("elastic-rt-train")
    job = find(recipe.docs, "Job", "elastic-rt-train")
    env = container_env(job["spec"]["template"]["spec"]["containers"][0], job)
    run_id = expand("$(ELASTIC_RT_RUN_ID)", env).replace(FAKE_UID, str(uuid.uuid4()))
    assert run_id.startswith("elastic-rt-train_")

    agents_argv = [agent_argv(recipe, creds, mount_path, run_id, f"pod-{i}", tmp_path / f"logs-{i}") for i in range(2)]
    agents = [launch(argv) for argv in agents_argv]
    try:
        results = [finish(a, 240) for a in agents]
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
    for rc, out in results:
        assert rc == 0, out[-4000:] + recipe.etcd_logs()
    assert "done steps=5 world_size=2" in "".join(out for _, out in results)

    # strangers, with what the recipe's Jobs hand out: no client certificate; another Job's user (its own
    # valid certificate and password) on this Job's run. The agent prints these errors as its one line
    # and exits 2 (tests/integration/test_etcd_tls_auth.py runs launches into each kind).
    conf = dict(kv.split("=", 1) for kv in rdzv_conf(agents_argv[0]).split(","))
    no_cert = {k: v for k, v in conf.items() if k not in ("cert", "key")}
    with pytest.raises(EtcdAccessError, match="requires a client certificate") as err:
        put_closed(recipe, no_cert, run_id)
    print(err.value)
    recipe.user_job("other-job")
    other, _ = recipe.credentials("other-job")
    intruder = {k: v.replace(str(creds), str(other)) for k, v in conf.items()} | {"user": "other-job"}
    with pytest.raises(EtcdAccessError, match="permission denied for user 'other-job'") as err:
        put_closed(recipe, intruder, run_id)
    print(err.value)
    put_closed(recipe, intruder, "other-job_" + str(uuid.uuid4()))  # its own runs' keys it may write


def rdzv_conf(argv: list[str]) -> str:
    (conf,) = [a.split("=", 1)[1] for a in argv if a.startswith("--rdzv-conf=")]
    return conf


def put_closed(recipe: Recipe, conf: dict[str, str], run_id: str) -> None:
    """What a stranger would write to end a job: its run's `closed` key."""
    client = EtcdClient(etcd_config_from_conf(recipe.endpoints, conf, timeout_s=5.0, env={}))
    try:
        client.put(f"/elastic-rt/{run_id}/closed", b"1")
    finally:
        client.close()


def test_the_secrets_the_jobs_store_are_valid_objects(recipe):
    """What the stand-in kept is what kubectl (client side) made: Secrets valid on every supported version."""
    from k8s_support import supported_versions, validate_k8s

    names = {d["metadata"]["name"] for d in recipe.api.documents()}
    assert {"etcd-ca", "etcd-tls", "etcd-root"} <= names
    for doc in recipe.api.documents():
        for version in supported_versions():
            validate_k8s(doc, version)
    tls = recipe.api.secret("etcd-tls")
    assert set(tls) == {"ca.pem", "server.pem", "server.key", "jwt.key", "jwt.pub"}
    assert "ca.key" not in tls, "the members never get the CA's key"
