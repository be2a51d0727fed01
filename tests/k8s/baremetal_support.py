"""Shared by the bare-metal tests: running launch/ scripts, an ssh stand-in that runs the remote command
line with sh as sshd would, a stand-in `elastic-rt` that records its arguments and environment."""

from __future__ import annotations

import os
import random
import shlex
import socket
import subprocess
import sys
from pathlib import Path

from k8s_support import LAUNCH

HOSTS_SH = LAUNCH / "elastic-rt-hosts.sh"
ETCD_SH = LAUNCH / "etcd-cluster.sh"
SYSTEMD = LAUNCH / "systemd"

FAKE_SSH = """#!/bin/sh
# ssh stand-in: ssh [-o OPT]... HOST COMMAND... runs COMMAND with sh here, as sshd would there.
while [ $# -gt 0 ]; do
  case "$1" in
    -o|-p|-l|-i|-F|-J) shift 2 ;;
    -*) shift ;;
    *) break ;;
  esac
done
echo "$1" >>"$FAKE_SSH_LOG"
shift
printf '%s\\n' "$*" >>"$FAKE_SSH_LOG.argv"
exec sh -c "$*"
"""

# Records its argv and part of its environment, as `elastic-rt` on a host.
FAKE_ELASTIC_RT = """import json, os, sys
args = sys.argv[1:]
node = [a.split("=", 1)[1] for a in args if a.startswith("--node-id=")][0]
with open(os.path.join(os.environ["FAKE_OUT"], node + ".json"), "w") as f:
    json.dump({"argv": args, "FOO": os.environ.get("FOO"), "SECRET": os.environ.get("SECRET"), "pid": os.getpid(),
               "cwd": os.getcwd()}, f)
sys.exit(int(os.environ.get("FAKE_EXIT", "0")))
"""


def run(cmd: list[str], *, timeout: float = 90, env: dict | None = None, cwd: Path | None = None,
        check: bool = True, stdin: str | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=cwd, input=stdin)
    if check and proc.returncode != 0:
        raise AssertionError(f"{shlex.join(cmd)} exited {proc.returncode}\n{proc.stdout}\n{proc.stderr}")
    return proc


def free_port_block(hosts: list[str], count: int) -> int:
    """A port P such that P..P+count-1 are free on every host address."""
    for _ in range(200):
        base = random.randrange(20000, 60000)
        try:
            socks = []
            for h in hosts:
                for p in range(base, base + count):
                    s = socket.socket()
                    socks.append(s)
                    s.bind((h, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no free port block")


def make_fake_ssh(tmp_path: Path) -> tuple[str, Path]:
    """(the --ssh command, the log of the hosts it was asked for); every command line it ran goes
    to the log's .argv sibling."""
    path = tmp_path / "fake-ssh"
    path.write_text(FAKE_SSH)
    path.chmod(0o755)
    return f"{path} -o BatchMode=yes", tmp_path / "ssh.log"


def env_with(**extra) -> dict:
    env = dict(os.environ)
    env.update({k: str(v) for k, v in extra.items()})
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '')}"
    return env


TRICKY = ["--nnodes=2:2", "--rdzv-endpoint=127.0.0.1:2379", "--rdzv-id", "job-7", "--log-dir=/logs/%h", "train.py",
          "it's", "a b", "$HOME", "*", 'x"y', "--lr=0.1"]


def hosts_run(tmp_path: Path, via: str, ssh: str | None, hosts: list[tuple[str, str]], args: list[str],
              extra: list[str] | None = None, default_state: bool = False, stdin: str | None = None,
              **env) -> subprocess.CompletedProcess:
    """hosts.sh run with the stand-in elastic-rt; state in tmp/run unless default_state; extra: more options."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("# test hosts\n" + "".join(f"{h} {a}  # comment\n" for h, a in hosts) + "\n")
    fake = tmp_path / "fake_elastic_rt.py"
    fake.write_text(FAKE_ELASTIC_RT)
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    cmd = [str(HOSTS_SH), "-f", str(hostfile), "--via", via, "--log-dir", str(tmp_path / "logs"),
           "--workdir", str(tmp_path), "--elastic-rt", f"{sys.executable} {fake}", "-e", "FOO=a b'c $x",
           *(extra or [])]
    if not default_state:
        cmd += ["--run-dir", str(tmp_path / "run")]
    if ssh:
        cmd += ["--ssh", ssh]
    return run([*cmd, "run", "--", *args], check=False, env=env_with(FAKE_OUT=out, **env), stdin=stdin)


