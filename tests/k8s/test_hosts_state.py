"""launch/elastic-rt-hosts.sh on a shared host: its state lives in a private (0700) directory of the
user's, never in a directory or a pid file that someone else could have placed; it signals only the
job's own agent; secrets reach the agents through a file or stdin, never a command line. Run for real
on this machine (--via local, and the ssh stand-in that runs the remote command line with sh)."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from baremetal_support import HOSTS_SH, TRICKY, env_with, hosts_run, make_fake_ssh, run
from tests.support.tools import require_tool

HOST = ("127.0.0.2", "127.0.0.2")
SECRET = "s3cr3t-Tok3n with spaces and 'quotes'"


def mode(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def ran(tmp_path: Path) -> bool:
    return (tmp_path / "out" / f"{HOST[0]}.json").exists()


def host_log(tmp_path: Path) -> str:
    return (tmp_path / "logs" / f"{HOST[0]}.log").read_text()


def test_state_lives_in_the_users_runtime_directory(tmp_path):
    xdg = tmp_path / "xdg"
    xdg.mkdir(mode=0o700)
    proc = hosts_run(tmp_path, "local", None, [HOST], TRICKY, default_state=True, XDG_RUNTIME_DIR=str(xdg))
    assert proc.returncode == 0, proc.stderr + host_log(tmp_path)
    rec = json.loads((tmp_path / "out" / f"{HOST[0]}.json").read_text())
    pid_file = xdg / "elastic-rt" / "job-7" / f"{HOST[0]}.pid"
    assert int(pid_file.read_text()) == rec["pid"]
    assert mode(xdg / "elastic-rt") == mode(pid_file.parent) == 0o700


def test_state_falls_back_to_a_private_directory_it_makes(tmp_path):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    proc = hosts_run(tmp_path, "local", None, [HOST], TRICKY, default_state=True,
                     XDG_RUNTIME_DIR=str(tmp_path / "none"), TMPDIR=str(tmp))
    assert proc.returncode == 0, proc.stderr + host_log(tmp_path)
    base = tmp / f"elastic-rt-{os.getuid()}"
    assert mode(base) == mode(base / "job-7") == 0o700
    assert (base / "job-7" / f"{HOST[0]}.pid").is_file()


@pytest.mark.parametrize("case", ["symlink", "open to others", "another user's"])
def test_a_state_directory_that_is_not_private_is_refused(tmp_path, case):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    base = tmp / f"elastic-rt-{os.getuid()}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    if case == "symlink":  # placed by someone who wants our pid files written elsewhere
        base.symlink_to(elsewhere)
    elif case == "open to others":
        base.mkdir()
        base.chmod(0o777)
    else:
        if os.geteuid() != 0:
            pytest.skip("needs root to make a directory owned by another user")
        base.mkdir(mode=0o700)
        os.chown(base, 65534, 65534)
    proc = hosts_run(tmp_path, "local", None, [HOST], TRICKY, default_state=True,
                     XDG_RUNTIME_DIR=str(tmp_path / "none"), TMPDIR=str(tmp))
    assert proc.returncode == 2, proc.stderr
    refusals = [line for line in host_log(tmp_path).splitlines() if "refusing" in line]
    assert len(refusals) == 1 and "must be a directory of uid" in refusals[0], host_log(tmp_path)
    assert not ran(tmp_path), "the agent started anyway"
    assert not any(elsewhere.iterdir()), "something was written through the link"


def test_a_pid_file_that_is_a_symlink_is_refused(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    state = tmp_path / "run" / "job-7"
    state.mkdir(parents=True, mode=0o700)
    (tmp_path / "run").chmod(0o700)
    (state / f"{HOST[0]}.pid").symlink_to(victim)
    proc = hosts_run(tmp_path, "local", None, [HOST], TRICKY)
    assert proc.returncode == 2 and "is a symbolic link" in host_log(tmp_path)
    assert not ran(tmp_path)
    drain = run([str(HOSTS_SH), "-H", HOST[0], "--via", "local", "--run-dir", str(tmp_path / "run"),
                 "--rdzv-id", "job-7", "drain", HOST[0]], check=False)
    assert drain.returncode != 0 and "is a symbolic link" in drain.stderr
    assert victim.read_text() == "precious\n"


def test_only_the_jobs_own_agent_is_signalled(tmp_path):
    """A pid file naming a process that is not this job's agent on that host (a stale file, a reused
    pid, a planted one) gets nothing signalled; the agent itself gets its SIGTERM."""
    state = tmp_path / "run" / "job-7"
    state.mkdir(parents=True, mode=0o700)
    (tmp_path / "run").chmod(0o700)
    pid_file = state / f"{HOST[0]}.pid"
    common = [str(HOSTS_SH), "-H", HOST[0], "--via", "local", "--run-dir", str(tmp_path / "run"), "--rdzv-id", "job-7"]
    sleeper = [sys.executable, "-c", "import time; time.sleep(120)"]
    bystander = subprocess.Popen(sleeper)
    other_node = subprocess.Popen([*sleeper, "launch", "--node-id=127.0.0.9", "--rdzv-id=job-7"])
    other_job = subprocess.Popen([*sleeper, "launch", f"--node-id={HOST[0]}", "--rdzv-id", "job-8"])
    agent = subprocess.Popen([*sleeper, "launch", f"--node-id={HOST[0]}", "--rdzv-id", "job-7"])
    try:
        for p in (bystander, other_node, other_job):
            pid_file.write_text(f"{p.pid}\n")
            out = run([*common, "--timeout", "5", "drain", HOST[0]]).stdout
            assert "not signalled" in out, out
            assert p.poll() is None, "a process that is not the agent was signalled"
            assert "not running" in run([*common, "status"]).stdout
        pid_file.write_text(f"{agent.pid}\n")
        assert f"running (pid {agent.pid})" in run([*common, "status"]).stdout
        reaper = threading.Thread(target=agent.wait)  # as its shell would: else drain waits on a zombie
        reaper.start()
        out = run([*common, "--timeout", "30", "drain", HOST[0]]).stdout
        assert "SIGTERM sent to agent" in out and "agent exited" in out, out
        reaper.join(timeout=30)
        assert agent.returncode == -15
    finally:
        for p in (bystander, other_node, other_job, agent):
            p.kill()
            p.wait()


@pytest.mark.parametrize("via, source", [("local", "file"), ("ssh", "stdin"), ("pdsh", "file")])
def test_secrets_reach_the_agents_through_a_file_never_a_command_line(tmp_path, via, source):
    if via == "pdsh":
        require_tool("pdsh", shutil.which("pdsh") is not None, "apt-get install pdsh")
    ssh, ssh_log = make_fake_ssh(tmp_path)
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"# the job's secrets\nSECRET={SECRET}\n")
    extra = ["--env-file", str(env_file) if source == "file" else "-"]
    hosts = [("127.0.0.2", "127.0.0.2"), ("127.0.0.3", "127.0.0.3")] if via == "pdsh" else \
        [("node-a", "127.0.0.2"), ("node-b", "127.0.0.3")]
    proc = hosts_run(tmp_path, via, None if via == "local" else ssh, hosts, TRICKY, extra=extra,
                     stdin=env_file.read_text() if source == "stdin" else None, FAKE_SSH_LOG=str(ssh_log))
    assert proc.returncode == 0, proc.stderr
    for host, _addr in hosts:
        rec = json.loads((tmp_path / "out" / f"{host}.json").read_text())
        assert rec["SECRET"] == SECRET, "the agent did not get the secret"
        assert SECRET not in json.dumps(rec["argv"])
        assert not (tmp_path / "run" / "job-7" / f"{host}.env").exists(), "the secret stayed on the host"
    if via != "local":
        remote = Path(str(ssh_log) + ".argv").read_text()
        assert "SECRET" not in remote and SECRET not in remote, "the secret crossed ssh on a command line"


def test_secrets_never_appear_in_ps(tmp_path):
    """While the agent runs, no process's command line on the machine carries the secret."""
    env_file = tmp_path / "secrets.env"
    env_file.write_text(f"SECRET={SECRET}\n")
    fake = tmp_path / "slow_elastic_rt.py"
    fake.write_text("import os, sys, time\n"
                    "open(os.environ['FAKE_OUT'] + '/started', 'w').write(os.environ.get('SECRET', ''))\n"
                    "time.sleep(60)\n")
    (tmp_path / "out").mkdir()
    cmd = [str(HOSTS_SH), "-H", "127.0.0.2", "--via", "local", "--run-dir", str(tmp_path / "run"),
           "--log-dir", str(tmp_path / "logs"), "--workdir", str(tmp_path), "--env-file", str(env_file),
           "--elastic-rt", f"{sys.executable} {fake}", "run", "--", *TRICKY]
    proc = subprocess.Popen(cmd, env=env_with(FAKE_OUT=str(tmp_path / "out")), start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "out" / "started").exists():
            assert proc.poll() is None and time.monotonic() < deadline, "the agent did not start"
            time.sleep(0.1)
        assert (tmp_path / "out" / "started").read_text() == SECRET
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            assert SECRET not in cmdline, f"pid {pid} shows the secret: {cmdline[:200]}"
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)


def test_a_bad_env_file_is_one_line(tmp_path):
    bad = tmp_path / "bad.env"
    bad.write_text("not a variable\n")
    proc = hosts_run(tmp_path, "local", None, [HOST], TRICKY, extra=["--env-file", str(bad)])
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0 and "NAME=VALUE" in proc.stderr
    proc = hosts_run(tmp_path, "local", None, [HOST], TRICKY, extra=["--env-file", str(tmp_path / "missing")])
    assert proc.returncode == 2 and "cannot read --env-file" in proc.stderr
    assert not ran(tmp_path)
