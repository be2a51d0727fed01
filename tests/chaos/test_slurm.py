"""launch/slurm/elastic-rt.sbatch on a real Slurm started here (tests/support/slurm.py): two slurmd on this
host, a job submitted with sbatch runs launch/train_example.py on both; one node's agent is SIGKILLed and
the other goes on at the smaller size; `scancel --signal=TERM` preempts the job, whose workers save and
whose script requeues it; the requeued run resumes from that checkpoint and the job ends COMPLETED.

Skipped where Slurm cannot start, unless CI=true (then it fails: .ci/run installs Slurm)."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.slurm import HOW, SlurmCluster, SlurmUnavailable, missing_tools
from tests.support.tools import needs_tool, require_tool

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "launch" / "slurm" / "elastic-rt.sbatch"
EXAMPLE = REPO / "launch" / "train_example.py"
STEPS = 24

pytestmark = [needs_tool("slurm", not missing_tools(), f"{HOW}; missing: {', '.join(missing_tools())}"),
              pytest.mark.slow]


@pytest.fixture
def slurm(tmp_path):
    cluster = SlurmCluster(tmp_path / "slurm", nodes=("n1", "n2"))
    try:
        cluster.start()
    except SlurmUnavailable as exc:
        cluster.stop()
        require_tool("slurm", False, f"its daemons did not start here: {exc}")
    try:
        yield cluster
    finally:
        cluster.stop()


def _output(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _wait_output(path: Path, pattern: str, timeout_s: float, *, after: int = 0) -> re.Match:
    """The first match of `pattern` in the job's output past offset `after`."""
    rx = re.compile(pattern, re.M)
    deadline = time.monotonic() + timeout_s
    while True:
        m = rx.search(_output(path), after)
        if m:
            return m
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {pattern!r} in the job's output within {timeout_s} s:\n{_output(path)[-6000:]}")
        time.sleep(0.3)


def _agent(job_id: str, node: str) -> psutil.Process:
    """The `elastic-rt launch` process that srun started for job_id on `node`."""
    for proc in psutil.process_iter(["cmdline"]):
        try:
            cmdline, env = proc.info["cmdline"] or [], proc.environ()
        except (psutil.Error, OSError):
            continue
        if (env.get("SLURM_JOB_ID") == job_id and env.get("SLURMD_NODENAME") == node and "launch" in cmdline
                and "python" in Path(cmdline[0]).name):
            return proc
    raise LookupError(f"no agent of job {job_id} on {node}")


@pytest.mark.timeout(600)
def test_sbatch_job_survives_a_killed_task_and_a_preemption(slurm, etcd_endpoint, tmp_path):
    out = tmp_path / "job.out"
    env = {
        "PATH": f"{Path(sys.executable).parent}:/usr/sbin:/usr/bin:/sbin:/bin",
        "HOME": str(tmp_path),
        "ELASTIC_RT": str(Path(sys.executable).parent / "elastic-rt"),
        "ELASTIC_RT_ETCD": etcd_endpoint,
        "ELASTIC_RT_MIN_NODES": "1",  # --nodes=1-2 below overrides the script's own 2-4
        "ELASTIC_RT_CHECKPOINT_URL": f"file://{tmp_path / 'ckpt'}",
    }
    job = slurm.sbatch([f"--nodes=1-2", f"--output={out}", f"--chdir={tmp_path}", str(SBATCH),
                        "--metrics-port", "0", "--warm-workers", "off", "--probe-bytes", "0",
                        str(EXAMPLE), "--steps", str(STEPS), "--step-sleep", "0.25", "--save-every", "3"], env=env)
    try:
        _wait_output(out, r"^checkpoint saved step=\d+ world_size=2 ", 240)
        _agent(job, "n2").kill()  # a task killed: its node is left behind
        _wait_output(out, r"^elastic-rt-slurm: n2 exit 137$", 60)
        one = _wait_output(out, r"^step=\d+ .*world_size=1$", 120)
        slurm.run("scancel", "--signal=TERM", job)  # preemption
        requeued = _wait_output(out, r"^elastic-rt-slurm: job \d+ run 1 on 2 node", 240, after=one.end())
        state = slurm.wait_job(job, lambda s: s.get("JobState") == "COMPLETED", 300)
    finally:
        transcript = _output(out)
        print(f"---- job {job} output ----\n{transcript}")
    first, second = transcript[:requeued.start()], transcript[requeued.start():]
    assert "elastic-rt-slurm: agents exited with: 137 143" in first  # killed, then preempted
    at_two = [int(s) for s in re.findall(r"^checkpoint saved step=(\d+) world_size=2", first, re.M)]
    alone = re.search(r"^start step=(\d+) world_size=1", first, re.M)
    assert at_two and alone and int(alone.group(1)) >= at_two[0], "n1 went on alone from the last checkpoint"
    saved = [int(s) for s in re.findall(r"^checkpoint saved step=(\d+) world_size=1", first, re.M)]
    stopped = re.search(r"^stopped steps=(\d+) world_size=1", first, re.M)
    assert stopped and saved and saved[-1] == int(stopped.group(1)), "the workers save when preempted"
    assert "requeueing job" in first and state["Restarts"] == "1" and state["ExitCode"] == "0:0"
    resumed = re.search(r"^start step=(\d+) world_size=\d", second, re.M)  # its first start, at any size
    assert resumed and int(resumed.group(1)) == saved[-1], "the requeued run resumes from the preemption save"
    assert re.search(rf"^done steps={STEPS} world_size=2 ", second, re.M)
    assert "elastic-rt-slurm: the training finished" in second
