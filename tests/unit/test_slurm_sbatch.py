"""launch/slurm/elastic-rt.sbatch's decisions, with stand-ins for srun and scontrol (the real Slurm run is
tests/chaos/test_slurm.py): the flags it gives each agent, and what each mix of the agents' exit codes
makes of the job (finished, requeued, or not requeued)."""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from tests.support.tools import needs_tool

SBATCH = Path(__file__).resolve().parents[2] / "launch" / "slurm" / "elastic-rt.sbatch"

# srun: runs the task command once per node of $FAKE_NODES, as slurmstepd would (SLURMD_NODENAME set)
SRUN = textwrap.dedent("""\
    #!/bin/bash
    echo "$*" > "$FAKE_DIR/srun.args"
    while [ "${1#-}" != "$1" ]; do shift; done
    worst=0
    for node in $FAKE_NODES; do
        SLURMD_NODENAME=$node "$@"
        code=$?
        [ "$code" -gt "$worst" ] && worst=$code
    done
    exit "$worst"
""")
# elastic-rt: records its arguments and exits with $FAKE_EXIT_<node>
AGENT = textwrap.dedent("""\
    #!/bin/bash
    echo "$*" > "$FAKE_DIR/agent-$SLURMD_NODENAME.args"
    code_var=FAKE_EXIT_$SLURMD_NODENAME
    exit "${!code_var:-0}"
""")
SCONTROL = '#!/bin/bash\necho "$*" >> "$FAKE_DIR/scontrol.calls"\n'


@pytest.fixture
def job(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("srun", SRUN), ("elastic-rt", AGENT), ("scontrol", SCONTROL)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)

    def run(exits: dict[str, int], **env) -> tuple[subprocess.CompletedProcess, Path]:
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM", "ELASTIC_RT"))}
        environ.update(PATH=f"{bin_dir}:{environ['PATH']}", FAKE_DIR=str(tmp_path), FAKE_NODES=" ".join(exits),
                       SLURM_JOB_ID="42", SLURM_JOB_NUM_NODES=str(len(exits)), SLURM_JOB_NODELIST="n[1-9]",
                       SLURM_SUBMIT_DIR=str(tmp_path), ELASTIC_RT_ETCD="etcd:2379", TMPDIR=str(tmp_path),
                       **{f"FAKE_EXIT_{n}": str(c) for n, c in exits.items()})
        environ.update(env)
        proc = subprocess.run(["bash", str(SBATCH), "--nproc-per-node", "2", "train.py", "--lr", "0.1"],
                              env=environ, capture_output=True, text=True, timeout=60)
        return proc, tmp_path

    return run


def _requeued(d: Path) -> bool:
    calls = d / "scontrol.calls"
    return calls.exists() and "requeue 42" in calls.read_text()


def test_each_agent_gets_the_jobs_flags_then_the_users(job):
    proc, d = job({"n1": 0, "n2": 0, "n3": 0})
    assert proc.returncode == 0, proc.stderr
    args = (d / "agent-n2.args").read_text().split()
    assert args[:3] == ["launch", "--node-id", "n2-r0"]
    flags = " ".join(args)
    assert "--nnodes 2:3 " in flags  # MIN from the script's '#SBATCH --nodes=2-4', MAX the allocation
    assert "--rdzv-backend etcd-v3 --rdzv-endpoint etcd:2379 --rdzv-id slurm-42 " in flags
    assert f"--checkpoint-url file://{d}/checkpoints/slurm-42 " in flags
    assert flags.endswith("--nproc-per-node 2 train.py --lr 0.1")
    assert "--no-kill" in (d / "srun.args").read_text()
    assert "the training finished" in proc.stderr and not _requeued(d)


def test_min_nodes_from_the_environment_and_the_run_number(job):
    proc, d = job({"n1": 0, "n2": 0}, ELASTIC_RT_MIN_NODES="1", SLURM_RESTART_COUNT="2")
    assert proc.returncode == 0, proc.stderr
    assert "--node-id n1-r2 --nnodes 1:2 " in (d / "agent-n1.args").read_text()


def test_one_finished_agent_means_the_training_finished(job):
    proc, d = job({"n1": 137, "n2": 0})  # a node killed earlier, the other finished the job
    assert proc.returncode == 0 and not _requeued(d), proc.stderr


def test_preempted_agents_requeue_the_job(job):
    proc, d = job({"n1": 143, "n2": 143, "n3": 137})
    assert _requeued(d), proc.stderr
    assert "agents exited with: 137 143" in proc.stderr and "requeueing job 42" in proc.stderr


@pytest.mark.parametrize("code,env", [(2, {}), (3, {}), (127, {}), (75, {"ELASTIC_RT_NO_REQUEUE": "2,75"})],
                         ids=["bad-config", "crash-loop", "no-command", "listed-code"])
def test_codes_a_requeue_cannot_fix_end_the_job(job, code, env):
    proc, d = job({"n1": code, "n2": 143}, **env)
    assert proc.returncode == code and not _requeued(d), proc.stderr
    assert f"exit code {code}: not requeued" in proc.stderr


def test_requeues_stop_at_the_limit(job):
    proc, d = job({"n1": 1}, SLURM_RESTART_COUNT="3")
    assert proc.returncode == 1 and not _requeued(d)
    assert "already requeued 3 times" in proc.stderr


def test_without_etcd_one_line_and_exit_2(job):
    proc, d = job({"n1": 0}, ELASTIC_RT_ETCD="")
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert "set ELASTIC_RT_ETCD" in proc.stderr and not (d / "srun.args").exists()


@needs_tool("shellcheck", shutil.which("shellcheck") is not None, "apt-get install shellcheck")
def test_shellcheck():
    proc = subprocess.run(["shellcheck", "--severity=style", str(SBATCH)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
