"""What k8s/ ships is secure by default, read from the rendered manifests: each kustomization states
its Pod Security Standard level and its pods meet exactly that level (tests/k8s/pss.py evaluates the
standard's controls); training runs as a non-root user everywhere; etcd and the agents speak TLS with
client certificates and per-job users everywhere but the overlay named plaintext-try; the
NetworkPolicies admit only the job's own pods, Prometheus on the metrics ports, and etcd's clients."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from k8s_support import (
    FAKE_NAMESPACE,
    K8S,
    current_kustomize,
    elastic_rt_launches,
    fake_pod_meta,
    kustomization_dirs,
    load_docs,
    pod_template,
    rel,
    rendered_cached,
)
from pss import VERSION, Level, baseline_violations, level_of, restricted_violations

NEED_CURRENT = pytest.mark.skipif(current_kustomize() is None, reason="no current kustomize (kubectl >= 1.21)")
STATED = re.compile(r"^# Pod Security Standard \((v[0-9.]+)\): (privileged|baseline|restricted)$", re.M)
PLAINTEXT = "elastic-rt.io/etcd-security"
CREDENTIAL_KEYS = {"ca.pem", "client.pem", "client.key", "password"}  # what etcd-pki.sh k8s-job-user stores


def stated_level(directory: Path) -> Level:
    m = STATED.findall((directory / "kustomization.yaml").read_text())
    assert len(m) == 1, f"{rel(directory)}: state the level once: '# Pod Security Standard ({VERSION}): LEVEL'"
    assert m[0][0] == VERSION, f"{rel(directory)}: the tests evaluate the standard of {VERSION}"
    return Level[m[0][1].upper()]


def with_pods(docs: list[dict]) -> list[dict]:
    return [d for d in docs if pod_template(d) is not None]


def is_plaintext(docs: list[dict]) -> bool:
    """Whether the deployment's etcd and training workloads say they are plaintext (all or none)."""
    marks = {(d["metadata"].get("annotations") or {}).get(PLAINTEXT) for d in docs
             if d["kind"] == "StatefulSet" or list(elastic_rt_launches([d]))}
    assert len(marks) <= 1, f"the annotation {PLAINTEXT} must be on etcd and the training Job, or on neither"
    return marks == {"plaintext"}


# ---- Pod Security Standards --------------------------------------------------------
POD_DIRS = [d for d in kustomization_dirs() if d.name != "monitoring"]


@NEED_CURRENT
@pytest.mark.parametrize("directory", POD_DIRS, ids=[rel(d) for d in POD_DIRS])
def test_each_kustomization_meets_the_level_it_states(directory: Path):
    level = stated_level(directory)
    pods = with_pods(rendered_cached()[rel(directory)])
    assert pods
    for doc in pods:
        spec = pod_template(doc)["spec"]
        what = f"{rel(directory)}: {doc['kind']}/{doc['metadata']['name']}"
        problems = {Level.RESTRICTED: restricted_violations, Level.BASELINE: baseline_violations}.get(level)
        assert problems is None or not problems(spec), f"{what} is not {level.name}: {problems(spec)}"
    tightest = min(level_of(pod_template(d)["spec"]) for d in pods)
    assert tightest == level, f"{rel(directory)} states {level.name} but its pods meet {tightest.name}"


def test_every_kustomization_with_pods_states_a_level():
    for d in POD_DIRS:
        stated_level(d)


@pytest.mark.parametrize("control, spec", [
    ("Host Namespaces", {"hostNetwork": True, "containers": [{"name": "c"}]}),
    ("Privileged Containers", {"containers": [{"name": "c", "securityContext": {"privileged": True}}]}),
    ("Capabilities", {"containers": [{"name": "c", "securityContext": {"capabilities": {"add": ["IPC_LOCK"]}}}]}),
    ("HostPath Volumes", {"containers": [{"name": "c"}], "volumes": [{"name": "v", "hostPath": {"path": "/"}}]}),
    ("Host Ports", {"containers": [{"name": "c", "ports": [{"containerPort": 1, "hostPort": 1}]}]}),
    ("Seccomp", {"securityContext": {"seccompProfile": {"type": "Unconfined"}}, "containers": [{"name": "c"}]}),
    ("Sysctls", {"securityContext": {"sysctls": [{"name": "kernel.msgmax", "value": "1"}]},
                 "containers": [{"name": "c"}]}),
])
def test_baseline_controls_fail_what_they_should(control, spec):
    assert any(v.startswith(control) for v in baseline_violations(spec)), baseline_violations(spec)
    assert level_of(spec) == Level.PRIVILEGED


RESTRICTED_POD = {
    "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "seccompProfile": {"type": "RuntimeDefault"}},
    "containers": [{"name": "c", "securityContext": {"allowPrivilegeEscalation": False,
                                                      "capabilities": {"drop": ["ALL"]}}}],
    "volumes": [{"name": "v", "emptyDir": {}}],
}


@pytest.mark.parametrize("control, change", [
    ("Running as Non-root", lambda s: s["securityContext"].pop("runAsNonRoot")),
    ("Running as Non-root user", lambda s: s["securityContext"].update(runAsUser=0)),
    ("Privilege Escalation", lambda s: s["containers"][0]["securityContext"].pop("allowPrivilegeEscalation")),
    ("Seccomp", lambda s: s["securityContext"].pop("seccompProfile")),
    ("Capabilities", lambda s: s["containers"][0]["securityContext"]["capabilities"].update(drop=[])),
    ("Volume Types", lambda s: s["volumes"].append({"name": "n", "nfs": {"server": "x", "path": "/"}})),
])
def test_restricted_controls_fail_what_they_should(control, change):
    import copy

    assert level_of(RESTRICTED_POD) == Level.RESTRICTED
    spec = copy.deepcopy(RESTRICTED_POD)
    change(spec)
    assert any(v.startswith(control) for v in restricted_violations(spec)), restricted_violations(spec)
    assert level_of(spec) == Level.BASELINE


@NEED_CURRENT
@pytest.mark.parametrize("name", ["k8s/overlays/gpu", "k8s/overlays/gpu-hostnetwork"])
def test_gpu_training_runs_as_a_non_root_user(name: str):
    for _job, spec, c, _argv in elastic_rt_launches(rendered_cached()[name]):
        psc, sc = spec.get("securityContext") or {}, c.get("securityContext") or {}
        assert sc.get("runAsNonRoot", psc.get("runAsNonRoot")) is True
        assert sc.get("runAsUser", psc.get("runAsUser")) not in (None, 0)
        assert sc.get("allowPrivilegeEscalation") is False and "ALL" in sc["capabilities"]["drop"]
        assert not sc["capabilities"].get("add"), "added capabilities have no effect for a non-root user"


# ---- TLS and auth by default --------------------------------------------------------
def etcd_flags(sts: dict) -> dict[str, str]:
    c = sts["spec"]["template"]["spec"]["containers"][0]
    return dict(str(a)[2:].split("=", 1) for a in c["args"] if str(a).startswith("--") and "=" in str(a))


def secret_volumes(spec: dict, container: dict) -> dict[str, tuple[str, str]]:
    """mount path -> (volume name, Secret name) for the container's Secret volumes."""
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    return {m["mountPath"].rstrip("/"): (m["name"], vols[m["name"]]["secret"]["secretName"])
            for m in container.get("volumeMounts", []) if "secret" in vols.get(m["name"], {})}


def check_secure(docs: list[dict], where: str) -> None:
    sts = [d for d in docs if d["kind"] == "StatefulSet"]
    for s in sts:
        f = etcd_flags(s)
        for url in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls", "initial-advertise-peer-urls"):
            assert f[url].startswith("https://"), f"{where}: etcd --{url} {f[url]}"
        assert all(u.split("=", 1)[1].startswith("https://") for u in f["initial-cluster"].split(","))
        assert f.get("client-cert-auth") == "true" and f.get("peer-client-cert-auth") == "true", where
        assert f.get("trusted-ca-file") and f.get("peer-trusted-ca-file"), where
        assert f.get("peer-cert-allowed-cn") == "etcd-member", f"{where}: a job's certificate could pose as a peer"
        assert f.get("auth-token", "").startswith("jwt,"), f"{where}: signed, expiring tokens"
        spec = s["spec"]["template"]["spec"]
        mounts = secret_volumes(spec, spec["containers"][0])
        tls_files = [f[k] for k in ("cert-file", "key-file", "trusted-ca-file")]
        assert all(any(p.startswith(m + "/") and sec == "etcd-tls" for m, (_, sec) in mounts.items())
                   for p in tls_files), f"{where}: etcd's TLS files are not in the Secret etcd-tls"
        assert any(d["kind"] == "Job" and d["metadata"]["name"] == "etcd-pki" for d in docs), \
            f"{where}: nothing makes the Secret etcd-tls"
    for job, spec, c, argv in elastic_rt_launches(docs):
        from k8s_support import parse_launch

        _args, cfg = parse_launch(argv)
        job_name = job["metadata"]["name"]
        assert all(e.strip().startswith("https://") for e in cfg.rdzv_endpoint.split(",")), where
        assert {"ca_cert", "cert", "key", "user", "password_file"} <= set(cfg.conf), f"{where}: {cfg.conf}"
        assert "password" not in cfg.conf, "a password on the command line shows in ps"
        assert cfg.conf["user"] == job_name, f"{where}: the user the etcd-user Job makes is the Job's name"
        assert cfg.rdzv_id.startswith(job_name + "_"), f"{where}: run id {cfg.rdzv_id} outside the role's prefix"
        mounts = secret_volumes(spec, c)
        for key in ("ca_cert", "cert", "key", "password_file"):
            mount, file = cfg.conf[key].rsplit("/", 1)
            assert mount in mounts, f"{where}: {key}={cfg.conf[key]} is not on a Secret volume"
            assert mounts[mount][1] == f"{job_name}-etcd" and file in CREDENTIAL_KEYS, f"{where}: {key}"
        users = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == f"{job_name}-etcd-user"]
        assert users, f"{where}: no etcd-user Job makes {job_name}'s credentials"
        uc = users[0]["spec"]["template"]["spec"]["containers"][0]
        assert uc["command"][-2:] == ["k8s-job-user", job_name], uc["command"]
        roles = [d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == f"{job_name}-etcd-user"]
        named = [r for rule in roles[0]["rules"] for r in rule.get("resourceNames", [])]
        assert named == [f"{job_name}-etcd"], f"{where}: the etcd-user Job may read and change only its Secret"


@NEED_CURRENT
@pytest.mark.parametrize("name", [n for n in rendered_cached() if not n.endswith("monitoring")])
def test_tls_and_auth_everywhere_but_the_plaintext_overlay(name: str):
    docs = rendered_cached()[name]
    if not is_plaintext(docs):
        if any(d["kind"] in ("StatefulSet", "Job") for d in docs):
            check_secure(docs, name)
        return
    assert "plaintext" in Path(name).name, f"{name}: a plaintext deployment must say so in its name"
    for d in docs:
        assert d["kind"] not in ("Role", "RoleBinding", "ServiceAccount"), f"{name}: {d['kind']} left over"
        assert not (d["kind"] == "Job" and "etcd" in d["metadata"]["name"]), name
    for s in [d for d in docs if d["kind"] == "StatefulSet"]:
        f = etcd_flags(s)
        assert f["listen-client-urls"].startswith("http://") and "client-cert-auth" not in f
        assert not secret_volumes(s["spec"]["template"]["spec"], s["spec"]["template"]["spec"]["containers"][0])
    for _job, spec, c, argv in elastic_rt_launches(docs):
        assert not secret_volumes(spec, c)


def test_only_the_plaintext_overlay_is_plaintext():
    for d in kustomization_dirs():
        marked = any(f"{PLAINTEXT}: plaintext" in p.read_text() for p in d.glob("*.yaml"))
        assert marked == (d.name == "plaintext-try"), rel(d)


def test_the_base_sources_are_secure():
    """The same checks on k8s/etcd + k8s/job read directly (no kustomize needed)."""
    docs = [d for sub in ("etcd", "job") for p in sorted((K8S / sub).glob("*.yaml"))
            if p.name != "kustomization.yaml" for d in load_docs(p)]
    check_secure(docs, "k8s/etcd + k8s/job")
    for doc in with_pods(docs):
        assert level_of(pod_template(doc)["spec"]) == Level.RESTRICTED, doc["metadata"]["name"]


# ---- NetworkPolicies ----------------------------------------------------------------
def _selects(selector: dict | None, labels: dict[str, str]) -> bool:
    assert not (selector or {}).get("matchExpressions"), "the evaluator reads matchLabels only"
    return all(labels.get(k) == v for k, v in ((selector or {}).get("matchLabels") or {}).items())


def _ip_in(ip: str, cidr: str) -> bool:
    import ipaddress

    return ipaddress.ip_address(ip) in ipaddress.ip_network(cidr)


def admitted(policies: list[dict], dst: dict, src: dict, port: int) -> bool:
    """Whether NetworkPolicy admits a TCP connection from src to dst:port (both in FAKE_NAMESPACE unless
    src says otherwise; src: labels, ns_labels, ip). Policies that select dst for Ingress must admit it."""
    selecting = [p for p in policies if _selects(p["spec"]["podSelector"], dst["labels"])
                 and "Ingress" in p["spec"].get("policyTypes", ["Ingress"])]
    if not selecting:
        return True
    same_ns = src.get("ns_labels", {}).get("kubernetes.io/metadata.name") == FAKE_NAMESPACE
    for p in selecting:
        for rule in p["spec"].get("ingress", []):
            ports = rule.get("ports")
            if ports and not any(pp.get("port") == port and pp.get("protocol", "TCP") == "TCP" for pp in ports):
                continue
            if "from" not in rule:
                return True
            for peer in rule["from"]:
                if "ipBlock" in peer:
                    if src.get("ip") and _ip_in(src["ip"], peer["ipBlock"]["cidr"]):
                        return True
                    continue
                ns_ok = _selects(peer["namespaceSelector"], src.get("ns_labels", {})) if "namespaceSelector" in peer \
                    else same_ns
                if ns_ok and "labels" in src and _selects(peer.get("podSelector"), src["labels"]):
                    return True
    return False


def pods_of(docs: list[dict]) -> dict[str, dict]:
    ns = {"kubernetes.io/metadata.name": FAKE_NAMESPACE}
    (job, *_), = elastic_rt_launches(docs)
    _name, job_labels = fake_pod_meta(job)
    other_job = dict(job_labels, **{"batch.kubernetes.io/job-name": "someone-else", "job-name": "someone-else"})
    sts = [d for d in docs if d["kind"] == "StatefulSet"][0]
    pki = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "etcd-pki"]
    pods = {
        "agent": {"labels": job_labels, "ns_labels": ns},
        "peer agent": {"labels": job_labels, "ns_labels": ns},
        "another job's agent": {"labels": other_job, "ns_labels": ns},
        "etcd member": {"labels": fake_pod_meta(sts)[1], "ns_labels": ns},
        "etcd-pki": {"labels": fake_pod_meta(pki[0])[1] if pki else {}, "ns_labels": ns},
        "prometheus": {"labels": {"app.kubernetes.io/name": "prometheus"},
                       "ns_labels": {"kubernetes.io/metadata.name": "monitoring"}},
        "stranger": {"labels": {"app": "x"}, "ns_labels": ns},
        "stranger elsewhere": {"labels": {"app": "x"}, "ns_labels": {"kubernetes.io/metadata.name": "other"}},
        "public address": {"ip": "203.0.113.9"},
    }
    if not pki:
        del pods["etcd-pki"]
    return pods


# (destination, port): the sources admitted; every other source of pods_of() is refused.
ADMITTED = {
    ("agent", 29500): {"peer agent", "agent"},          # TCPStore, collectives, liveness: any port
    ("agent", 41234): {"peer agent", "agent"},
    ("agent", 9402): {"peer agent", "agent", "prometheus"},
    ("etcd member", 2379): {"agent", "peer agent", "another job's agent", "etcd member", "etcd-pki"},
    ("etcd member", 2380): {"etcd member"},
    ("etcd member", 2381): {"etcd member", "prometheus"},
}


@NEED_CURRENT
@pytest.mark.parametrize("name", ["k8s/base", "k8s/overlays/cpu-smoke", "k8s/overlays/gpu",
                                  "k8s/overlays/plaintext-try", "k8s/overlays/gpu-hostnetwork"])
def test_network_policies_admit_only_the_jobs_pods(name: str):
    docs = rendered_cached()[name]
    policies = [d for d in docs if d["kind"] == "NetworkPolicy"]
    pods = pods_of(docs)
    host_net = any(spec.get("hostNetwork") for _j, spec, _c, _a in elastic_rt_launches(docs))
    for (dst, port), allowed in ADMITTED.items():
        if host_net and dst == "agent":
            continue  # NetworkPolicy does not apply to host-network pods (the overlay says so)
        for src_name, src in pods.items():
            got = admitted(policies, pods[dst], src, port)
            want = src_name in allowed
            if host_net and dst == "etcd member" and port == 2379 and src_name == "public address":
                want = False  # nodes' private addresses only
            assert got == want, f"{name}: {src_name} -> {dst}:{port} {'admitted' if got else 'refused'}"
    if host_net:
        node = {"ip": "10.4.0.7"}
        assert admitted(policies, pods["etcd member"], node, 2379), "host-network agents reach etcd"
        assert not admitted(policies, pods["etcd member"], node, 2380)
