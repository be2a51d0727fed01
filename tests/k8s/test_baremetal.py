"""launch/: the bare-metal recipes run for real on this machine. Hosts are loopback
addresses (127.0.0.2, 127.0.0.3, ...); "ssh" is a stand-in that runs the remote command
line with sh as sshd would, so the quoting that crosses ssh is exercised; pdsh runs for
real where it is installed. shellcheck must pass on every script."""

from __future__ import annotations

import configparser
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from baremetal_support import (
    ETCD_SH,
    HOSTS_SH,
    SYSTEMD,
    TRICKY,
    env_with,
    free_port_block,
    hosts_run,
    make_fake_ssh,
    run,
)
from k8s_support import LAUNCH, REPO
from tests.support.tools import needs_tool, require_tool

from elastic_rt.agent.crash_loop import CrashLoopError
from elastic_rt.errors import ConfigError, NodeExcludedError, RunClosedError

SCRIPTS = sorted(LAUNCH.glob("*.sh"))

@pytest.fixture
def fake_ssh(tmp_path) -> tuple[str, Path]:
    return make_fake_ssh(tmp_path)


# ---- static checks ---------------------------------------------------------------
def test_scripts_exist_and_are_executable():
    assert {p.name for p in SCRIPTS} >= {"elastic-rt-hosts.sh", "etcd-cluster.sh"}
    for p in SCRIPTS:
        assert os.access(p, os.X_OK), f"{p.name} is not executable"
        assert p.read_text().startswith("#!/usr/bin/env bash\n")


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_bash_syntax_and_help(script):
    run(["bash", "-n", str(script)])
    out = run([str(script), "--help"]).stdout
    assert out.startswith("Usage:")
    bad = run([str(script), "--no-such-option"], check=False)
    assert bad.returncode == 2 and "error" in bad.stderr


@needs_tool("shellcheck", shutil.which("shellcheck") is not None, "apt-get install shellcheck")
def test_shellcheck():
    proc = run(["shellcheck", "--severity=style", *map(str, SCRIPTS)], check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ---- elastic-rt-hosts.sh: command lines across ssh, pdsh and local --------------
@pytest.mark.parametrize("via", ["local", "ssh", "pdsh"])
def test_hosts_passes_every_argument_through(tmp_path, fake_ssh, via):
    if via == "pdsh":
        require_tool("pdsh", shutil.which("pdsh") is not None, "apt-get install pdsh")
    ssh, ssh_log = fake_ssh
    hosts = [("127.0.0.2", "127.0.0.2"), ("127.0.0.3", "127.0.0.3")] if via == "pdsh" else \
        [("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")]
    proc = hosts_run(tmp_path, via, None if via == "local" else ssh, hosts, TRICKY, FAKE_SSH_LOG=ssh_log)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for host, addr in hosts:
        rec = json.loads((tmp_path / "out" / f"{host}.json").read_text())
        ours = ["launch", f"--node-id={host}", f"--local-addr={addr}"]
        if via == "local":
            ours.append(f"--metrics-host={addr}")
        assert rec["argv"] == ours + [a.replace("%h", host) for a in TRICKY]
        assert rec["FOO"] == "a b'c $x"
        assert rec["cwd"] == str(tmp_path)
        # the pid file names the process that became elastic-rt
        assert int((tmp_path / "run" / "job-7" / f"{host}.pid").read_text()) == rec["pid"]
        assert (tmp_path / "logs" / f"{host}.log").exists()
    if via != "local":
        assert sorted(ssh_log.read_text().split()) == sorted(h for h, _ in hosts)


def test_hosts_reports_a_failed_host(tmp_path):
    proc = hosts_run(tmp_path, "local", None, [("127.0.0.2", "127.0.0.2")], TRICKY, FAKE_EXIT=1)
    assert proc.returncode == 1
    assert "127.0.0.2: exit code 1" in proc.stderr


def test_hosts_refuses_what_it_sets_itself(tmp_path):
    proc = hosts_run(tmp_path, "local", None, [("127.0.0.2", "127.0.0.2")], ["--node-id=x", *TRICKY])
    assert proc.returncode == 2 and "--node-id" in proc.stderr
    proc = hosts_run(tmp_path, "local", None, [("127.0.0.2", "127.0.0.2")], ["train.py"])
    assert proc.returncode == 2 and "--rdzv-id" in proc.stderr


# ---- etcd-cluster.sh with a real etcd ----------------------------------------------
ETCD_HOSTS = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]


@pytest.fixture(scope="module")
def etcd3(tmp_path_factory):
    """A 3-member etcd started by launch/etcd-cluster.sh --local on 127.0.0.2-4 as it ships (TLS, client
    certificates, auth; its PKI in tmp/pki), shared by this module's tests (each job uses its own run id
    and user)."""
    from etcd_testbed.server import find_etcd_binary, find_etcdctl

    tmp_path = tmp_path_factory.mktemp("etcd3")
    port = free_port_block(ETCD_HOSTS, 3)
    opts = ["--local", "--etcd", find_etcd_binary(), "--etcdctl", find_etcdctl(find_etcd_binary()),
            "--pki", str(tmp_path / "pki"), "--data-root", str(tmp_path / "etcd"),
            "--client-port", str(port), "--peer-port", str(port + 1), "--metrics-port", str(port + 2),
            "--token", f"t{port}", "--timeout", "60"]
    started = run([str(ETCD_SH), *opts, "start", *ETCD_HOSTS])
    try:
        yield opts, port, started
    finally:
        run([str(ETCD_SH), *opts, "stop", *ETCD_HOSTS], check=False)
        for pid_file in (tmp_path / "etcd").glob("*.pid"):  # whatever stop missed
            try:
                os.kill(int(pid_file.read_text()), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass


def etcd_client(endpoints: str, conf: dict[str, str]):
    from elastic_rt.rendezvous.etcd_client import EtcdClient
    from elastic_rt.rendezvous.registration import etcd_config_from_conf

    return EtcdClient(etcd_config_from_conf(endpoints, conf, timeout_s=5.0, env={}))


def job_user(etcd3, run_id: str) -> tuple[str, str]:
    """`etcd-cluster.sh job-user`: the (--rdzv-endpoint=..., --rdzv-conf=...) of a job's agents."""
    opts, _port, _started = etcd3
    out = run([str(ETCD_SH), *opts, "job-user", *ETCD_HOSTS, "--", run_id]).stdout.strip().splitlines()
    assert out[-2].startswith("--rdzv-endpoint=https://") and out[-1].startswith("--rdzv-conf="), out
    return out[-2], out[-1]


def test_etcd_cluster_start_status_stop(etcd3):
    opts, port, started = etcd3
    pki = Path(opts[opts.index("--pki") + 1])
    endpoint = started.stdout.strip().splitlines()[-1]
    assert endpoint == "--rdzv-endpoint=" + ",".join(f"https://{h}:{port}" for h in ETCD_HOSTS)
    status = run([str(ETCD_SH), *opts, "status", *ETCD_HOSTS]).stdout
    assert status.count("healthy") == 3 and "UNHEALTHY" not in status
    # every member serves the same data: write through one, read through another (as root, by its certificate)
    urls = endpoint.split("=", 1)[1].split(",")
    root = {"ca_cert": str(pki / "ca.pem"), "cert": str(pki / "root.pem"), "key": str(pki / "root.key")}
    c1, c2 = etcd_client(urls[0], root), etcd_client(urls[2], root)
    try:
        c1.put("/deploy-test", b"ok")
        kv = c2.get("/deploy-test")
        assert (kv[0] if isinstance(kv, tuple) else kv).value == b"ok"
    finally:
        c1.close()
        c2.close()
    again = run([str(ETCD_SH), *opts, "start", *ETCD_HOSTS]).stdout
    assert again.count("already running") == 3
    # a member stops: status says so; start brings it back with its data (it rejoins)
    run([str(ETCD_SH), *opts, "stop", ETCD_HOSTS[0]])
    after = run([str(ETCD_SH), *opts, "status", *ETCD_HOSTS], check=False)
    assert after.returncode == 1 and after.stdout.count("UNHEALTHY") == 1
    restarted = run([str(ETCD_SH), *opts, "start", *ETCD_HOSTS]).stdout
    assert restarted.count("already running") == 2 and "etcd-127-0-0-2 started" in restarted
    assert run([str(ETCD_SH), *opts, "status", *ETCD_HOSTS]).stdout.count("healthy") == 3
    c3 = etcd_client(urls[0], root)
    try:
        kv = c3.get("/deploy-test")
        assert (kv[0] if isinstance(kv, tuple) else kv).value == b"ok", "the restarted member kept its data"
    finally:
        c3.close()


def test_a_job_user_reaches_its_own_run_only(etcd3):
    """What etcd-cluster.sh job-user prints works for its run, and nothing else does: another run's keys,
    a client without a certificate, a plaintext client."""
    from elastic_rt.errors import EtcdAccessError

    endpoint, conf = job_user(etcd3, "bm-user-a")
    urls = endpoint.split("=", 1)[1]
    creds = dict(kv.split("=", 1) for kv in conf.split("=", 1)[1].split(","))
    assert creds["user"] == "bm-user-a" and oct(os.stat(creds["password_file"]).st_mode & 0o777) == "0o600"
    c = etcd_client(urls, creds)
    try:
        c.put("/elastic-rt/bm-user-a/k", b"v")
        with pytest.raises(EtcdAccessError, match="permission denied for user 'bm-user-a'"):
            c.put("/elastic-rt/bm-user-b/closed", b"1")
    finally:
        c.close()
    for url, conf_ in ((urls, {k: v for k, v in creds.items() if k not in ("cert", "key")}),
                       (urls.replace("https://", "http://"), {"user": "bm-user-a", "password_file": creds["password_file"],
                                                         "allow_plaintext_auth": "1"})):
        c = etcd_client(url, conf_)
        try:
            with pytest.raises(EtcdAccessError, match="requires a client certificate|speaks TLS"):
                c.put("/elastic-rt/bm-user-a/k", b"v")
        finally:
            c.close()


def env_files(*args: str) -> list[dict[str, str]]:
    out = run([str(ETCD_SH), *args, "env", "node1", "node2", "node3"]).stdout
    files = [b for b in out.strip().split("\n\n")]
    assert len(files) == 3
    return [dict(line.split("=", 1) for line in f.splitlines() if not line.startswith("#")) for f in files]


def test_etcd_cluster_env_files():
    first = env_files()[0]
    assert first["ETCD_NAME"] == "etcd-node1"
    assert first["ETCD_INITIAL_CLUSTER"] == ",".join(f"etcd-node{i}=https://node{i}:2380" for i in (1, 2, 3))
    assert first["ETCD_ADVERTISE_CLIENT_URLS"] == "https://node1:2379"
    d = "/var/lib/elastic-rt-etcd/pki/etcd-node1"
    assert first["ETCD_CLIENT_CERT_AUTH"] == first["ETCD_PEER_CLIENT_CERT_AUTH"] == "true"
    assert first["ETCD_CERT_FILE"] == first["ETCD_PEER_CERT_FILE"] == f"{d}/member.pem"
    assert first["ETCD_TRUSTED_CA_FILE"] == f"{d}/ca.pem" and first["ETCD_PEER_CERT_ALLOWED_CN"] == "etcd-member"
    assert first["ETCD_AUTH_TOKEN"].startswith(f"jwt,pub-key={d}/jwt.pub,")
    plain = env_files("--insecure-plaintext")[0]
    assert plain["ETCD_ADVERTISE_CLIENT_URLS"] == "http://node1:2379"
    assert not any(k.startswith(("ETCD_CERT", "ETCD_PEER_CERT", "ETCD_AUTH", "ETCD_CLIENT_CERT")) for k in plain)
    assert run([str(ETCD_SH), "env", "a", "b"], check=False).returncode == 2


# ---- the example job on two "hosts" against that etcd --------------------------------
def start_job(tmp_path: Path, etcd3, run_id: str, nnodes: str, job_args: list[str],
              grace: str = "10") -> tuple[subprocess.Popen, list[str]]:
    """The example job on two "hosts" with its own etcd user (etcd-cluster.sh job-user)."""
    endpoint, conf = job_user(etcd3, run_id)
    agent_hosts = ["127.0.0.2", "127.0.0.3"]
    mport = free_port_block(agent_hosts, 1)
    cmd = [str(HOSTS_SH), "-H", ",".join(agent_hosts), "--via", "local", "--run-dir", str(tmp_path / "run"),
           "--log-dir", str(tmp_path / "logs"), "--workdir", str(REPO), "run",
           f"--nnodes={nnodes}", "--nproc-per-node=1", endpoint, conf, f"--rdzv-id={run_id}",
           f"--metrics-port={mport}", f"--grace-period={grace}", "--probe-bytes=0",
           f"--log-dir={tmp_path / 'agent-logs' / '%h'}",
           "launch/train_example.py", *job_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env_with(), start_new_session=True)
    return proc, agent_hosts


def logs(tmp_path: Path) -> str:
    return "".join(p.read_text(errors="replace") for p in sorted((tmp_path / "logs").glob("*.log")))


def wait_job(proc: subprocess.Popen, tmp_path: Path, timeout: float) -> str:
    try:
        out, _ = proc.communicate(timeout=timeout)
        return out
    except subprocess.TimeoutExpired:
        stop_group(proc)
        raise AssertionError(f"the job did not end within {timeout:g} s; host logs:\n{logs(tmp_path)}") from None


def stop_group(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


@pytest.mark.slow
def test_job_runs_on_every_host(etcd3, tmp_path):
    proc, hosts = start_job(tmp_path, etcd3, f"bm-{os.getpid()}-{random.randrange(1 << 30)}", "2:2",
                            ["--steps=5", "--dataset-size=256"])
    try:
        out = wait_job(proc, tmp_path, 90)
    finally:
        stop_group(proc)
    text = logs(tmp_path)
    assert proc.returncode == 0, out + text
    assert "done steps=5 world_size=2" in text, text
    for h in hosts:
        assert f"{h}: exit code 0" in out
        assert (tmp_path / "logs" / f"{h}.log").read_text().strip()


@pytest.mark.slow
def test_drain_a_host_and_the_job_goes_on(etcd3, tmp_path):
    run_id = f"bm-drain-{os.getpid()}-{random.randrange(1 << 30)}"
    proc, hosts = start_job(tmp_path, etcd3, run_id, "1:2",
                            ["--steps=40", "--step-sleep=0.1", "--dataset-size=512"], grace="5")
    try:
        deadline = time.monotonic() + 90
        while "step=3 loss" not in logs(tmp_path) or "world_size=2" not in logs(tmp_path):
            assert proc.poll() is None, proc.communicate()[0] + logs(tmp_path)
            assert time.monotonic() < deadline, "the job did not start on both hosts\n" + logs(tmp_path)
            time.sleep(0.2)
        common = [str(HOSTS_SH), "-H", ",".join(hosts), "--via", "local", "--run-dir", str(tmp_path / "run"),
                  "--rdzv-id", run_id]
        assert "127.0.0.3: running" in run(common + ["status"]).stdout
        drained = run(common + ["--timeout", "60", "drain", "127.0.0.3"])
        assert "127.0.0.3: agent exited" in drained.stdout
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            if "127.0.0.2 round 0] workers finished" in logs(tmp_path):
                raise AssertionError("the survivor's workers exited 0 in the drained round and its agent "
                                     "took the job for finished:\n" + logs(tmp_path))
            time.sleep(0.2)
        out = wait_job(proc, tmp_path, 5)
    finally:
        stop_group(proc)
    text = logs(tmp_path)
    assert proc.returncode == 0, out + text
    assert "127.0.0.3: agent stopped by SIGTERM (drained)" in out
    assert "127.0.0.2: exit code 0" in out
    survivor = (tmp_path / "logs" / "127.0.0.2.log").read_text()
    assert "done steps=40 world_size=1" in survivor, survivor
    assert "127.0.0.2: not running" in run(common + ["status"]).stdout


# ---- systemd units -----------------------------------------------------------------
def read_unit(path: Path) -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None, delimiters=("=",))
    cp.optionxform = str  # keys are case-sensitive
    cp.read(path)
    return cp


def read_env_file(path: Path) -> dict[str, str]:
    out = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, v = line.split("=", 1)
            out[k] = v
    return out


def systemd_argv(exec_start: str, env: dict[str, str], instance: str, host: str) -> list[str]:
    """ExecStart as systemd splits it: %i/%H specifiers, $VAR split on whitespace, ${VAR} one word."""
    words = []
    for word in shlex.split(exec_start.replace("%i", instance).replace("%H", host)):
        if word.startswith("$") and not word.startswith("${"):
            words += env.get(word[1:], "").split()
        elif word.startswith("${") and word.endswith("}"):
            words.append(env.get(word[2:-1], ""))
        else:
            words.append(word)
    return words


def test_agent_unit_command_line_parses():
    from k8s_support import parse_launch

    unit = read_unit(SYSTEMD / "elastic-rt@.service")
    svc = unit["Service"]
    env = read_env_file(SYSTEMD / "elastic-rt.env.example")
    argv = systemd_argv(svc["ExecStart"], env, "job42", "node1")
    assert Path(argv[0]).name == "elastic-rt"
    _args, cfg = parse_launch(["elastic-rt", *argv[1:]])
    assert cfg.rdzv_id == "job42" and cfg.node_id == "node1" and cfg.max_nodes > cfg.min_nodes
    # the job's own etcd user over TLS, as etcd-cluster.sh job-user makes it
    assert all(e.startswith("https://") for e in cfg.rdzv_endpoint.split(","))
    assert {"ca_cert", "cert", "key", "user", "password_file"} <= set(cfg.conf) and cfg.conf["user"] == "job42"
    assert "password" not in cfg.conf
    assert cfg.script == env["ELASTIC_RT_SCRIPT"] and list(cfg.script_args) == env["ELASTIC_RT_SCRIPT_ARGS"].split()
    assert svc["KillMode"] == "mixed" and svc["KillSignal"] == "SIGTERM"
    assert int(svc["TimeoutStopSec"]) >= cfg.grace_period_s + 10, "systemd must not SIGKILL inside the grace period"
    assert str(ConfigError.exit_code) in svc["RestartPreventExitStatus"].split()
    assert {str(CrashLoopError.exit_code), str(NodeExcludedError.exit_code), str(RunClosedError.exit_code)} <= set(
        svc["RestartPreventExitStatus"].split())
    assert svc["Restart"] == "on-failure"
    assert "StartLimitBurst" in unit["Unit"]
    assert svc["LimitMEMLOCK"] == "infinity"


def test_etcd_unit_reads_the_env_file_etcd_cluster_writes():
    unit = read_unit(SYSTEMD / "elastic-rt-etcd.service")
    assert unit["Service"]["EnvironmentFile"] == "/etc/elastic-rt/etcd.env"
    assert "/etc/elastic-rt/etcd.env" in ETCD_SH.read_text()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed (systemd)")
@pytest.mark.parametrize("unit", ["elastic-rt@.service", "elastic-rt-etcd.service"])
def test_systemd_analyze_verify(tmp_path, unit):
    text = (SYSTEMD / unit).read_text()
    exe = shutil.which("true")
    # The binaries are not installed here: point ExecStart at one that exists, check the rest.
    text = text.replace("/opt/elastic-rt/venv/bin/elastic-rt", exe).replace("/usr/local/bin/etcd", exe)
    text = text.replace("/opt/elastic-rt/venv/bin/python", exe)
    name = unit.replace("@.service", "@job42.service")
    (tmp_path / name).write_text(text)
    proc = run(["systemd-analyze", "verify", "--man=no", str(tmp_path / name)], check=False)
    problems = [l for l in (proc.stdout + proc.stderr).splitlines()
                if l.strip() and "EnvironmentFile" not in l and "Failed to prepare filename" not in l]
    assert not problems, "\n".join(problems)
