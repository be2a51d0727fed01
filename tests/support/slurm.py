"""A real Slurm on this machine for tests: munged, slurmctld and one slurmd per node name (Debian's build runs
several slurmd on one host: `slurmd -N NAME`, each on a port of its own), in a directory of their own.

    with SlurmCluster(tmp_path, nodes=("n1", "n2")) as slurm:
        job = slurm.sbatch(["--nodes=1-2", "job.sbatch"])
        slurm.wait_job(job, lambda state: state["JobState"] == "COMPLETED", timeout_s=300)

Every command runs with SLURM_CONF pointing at this cluster's slurm.conf and MUNGE's socket at its own
munged; nothing of a system-wide Slurm is touched. A daemon that does not come up raises
SlurmUnavailable with its last log lines.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Callable

from etcd_testbed.server import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "srun")
HOW = "apt-get install munge slurmctld slurmd slurm-client"


class SlurmUnavailable(RuntimeError):
    """The Slurm daemons could not be started here."""


def outside_slurm(environ, **extra: str) -> dict[str, str]:
    """`environ` without the variables of a Slurm job this test may itself run in, plus `extra`."""
    return {**{k: v for k, v in environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}, **extra}


def missing_tools() -> list[str]:
    return [tool for tool in DAEMONS if shutil.which(tool) is None]


class SlurmCluster:
    """munged + slurmctld + a slurmd per node on 127.0.0.1; requeued jobs are eligible again after
    cred_expire_s + 1 s (Slurm's credential lifetime) and the scheduler looks every second."""

    def __init__(self, root: Path, *, nodes: tuple[str, ...] = ("n1", "n2"), cpus_per_node: int = 1,
                 cred_expire_s: int = 5) -> None:
        self.root, self.nodes, self.cpus, self.cred_expire_s = Path(root), nodes, cpus_per_node, cred_expire_s
        self.conf = self.root / "slurm.conf"
        # unix socket paths are limited to 108 bytes: a short directory of its own
        self._sock_dir = Path(tempfile.mkdtemp(prefix="ert-munge-"))
        self.munge_socket = self._sock_dir / "munge.socket"
        self._procs: dict[str, subprocess.Popen] = {}

    # ---- commands ------------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        return outside_slurm(os.environ, SLURM_CONF=str(self.conf))

    def run(self, *cmd: str, check: bool = True, timeout_s: float = 60) -> subprocess.CompletedProcess:
        proc = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip() or proc.stdout.strip()}")
        return proc

    def sbatch(self, args: list[str], env: dict[str, str] | None = None) -> str:
        """Submit; returns the job id. `env` is the submitting shell's environment (sbatch exports it)."""
        proc = subprocess.run(["sbatch", "--parsable", *args], env=outside_slurm(env or os.environ, SLURM_CONF=str(self.conf)),
                              capture_output=True, text=True, timeout=60)
        if proc.returncode != 0:
            raise RuntimeError(f"sbatch exited {proc.returncode}: {proc.stderr.strip()}")
        return proc.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, NodeList, ...); {} once purged."""
        proc = self.run("scontrol", "-o", "show", "job", job_id, check=False)
        fields: dict[str, str] = {}
        for item in proc.stdout.split():
            key, sep, value = item.partition("=")
            if sep:
                fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id: str, done: Callable[[dict[str, str]], bool], timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout_s
        while True:
            state = self.job(job_id)
            if done(state):
                return state
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} not as expected within {timeout_s} s: {state}")
            time.sleep(0.5)

    # ---- start and stop ------------------------------------------------------------------------
    def __enter__(self) -> "SlurmCluster":
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self, timeout_s: float = 60) -> None:
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd runs jobs as their users: it needs root")
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        key = self._sock_dir / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        self._spawn("munged", ["munged", "-F", "-f", f"--socket={self.munge_socket}", f"--key-file={key}",
                               f"--log-file={self.root / 'log' / 'munged.log'}",
                               f"--pid-file={self._sock_dir / 'munged.pid'}", f"--seed-file={self._sock_dir / 'seed'}"])
        self._wait(lambda: self.munge_socket.exists(), "munged", timeout_s)
        self.conf.write_text(self._slurm_conf())
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._wait(lambda: self.run("scontrol", "ping", check=False).stdout.count("UP") > 0, "slurmctld", timeout_s)
        for node in self.nodes:
            self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._all_idle, "slurmd", timeout_s)

    def stop(self) -> None:
        """Cancel what runs, then stop the daemons (SIGTERM, then SIGKILL), slurmd first."""
        if "slurmctld" in self._procs and self._procs["slurmctld"].poll() is None:
            self.run("scancel", "--user", str(os.geteuid()), check=False, timeout_s=30)
        order = [n for n in self._procs if n.startswith("slurmd-")] + ["slurmctld", "munged"]
        for name in order:
            proc = self._procs.get(name)
            if proc is None or proc.poll() is not None:
                continue
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()
        shutil.rmtree(self._sock_dir, ignore_errors=True)

    def _spawn(self, name: str, cmd: list[str]) -> None:
        out = open(self.root / "log" / f"{name}.out", "w")
        self._procs[name] = subprocess.Popen(cmd, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True)
        out.close()

    def _all_idle(self) -> bool:
        states = self.run("sinfo", "-h", "-N", "-o", "%N %t", check=False).stdout.split("\n")
        idle = {line.split()[0] for line in states if line.strip().endswith("idle")}
        return idle >= set(self.nodes)

    def _wait(self, ready: Callable[[], bool], what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [n for n, p in self._procs.items() if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                raise SlurmUnavailable(f"{what} did not come up ({', '.join(dead) + ' exited' if dead else 'timed out'}): "
                                       + self._logs_tail())
            time.sleep(0.2)

    def _logs_tail(self) -> str:
        tails = []
        for path in sorted((self.root / "log").glob("*")):
            lines = path.read_text(errors="replace").strip().splitlines()[-3:]
            if lines:
                tails.append(f"{path.name}: " + " | ".join(lines))
        return "; ".join(tails)

    def _slurm_conf(self) -> str:
        host, r = socket.gethostname().split(".")[0], self.root
        lines = [
            "ClusterName=ert-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire={self.cred_expire_s}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}/%n",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'spool'}/slurmd-%n.pid",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log'}/slurmd-%n.log",
            "ProctrackType=proctrack/pgid",
            "TaskPlugin=task/none",
            "SelectType=select/linear",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=1",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "ReturnToService=2",
            "KillWait=10",
            "MailProg=/bin/true",
            "PlugStackConfig=/dev/null",
        ]
        for node in self.nodes:
            lines.append(f"NodeName={node} NodeHostname={host} NodeAddr=127.0.0.1 Port={free_port()} "
                         f"CPUs={self.cpus} RealMemory=1000")
        lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"
