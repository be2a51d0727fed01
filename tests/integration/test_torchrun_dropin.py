"""`elastic-rt launch` in place of torchrun, on the same plain scripts (they never import elastic_rt).

Each test runs torchrun and elastic-rt side by side with the same flags, from the same directory and
parent environment, and compares what a user sees: the console lines under --local-ranks-filter, the
files of --duplicate-std*-filters and of a --logs-specs class found through its entry point, the
--event-log-handler events; the CPU affinity under --numa-binding (warm and cold workers) and the
environment under --virtual-local-rank. torchrun's static rendezvous (--node-rank, --master-addr,
--master-port) runs a DDP job end to end on two agents.

This machine has no GPU: for --numa-binding, tests/support/numa_shim.py answers the one question that
needs CUDA (the NUMA node of GPU N: node 0) in both launchers; torch computes the CPU sets from the real
topology, binds cold workers with the real numactl, and elastic-rt binds its warm workers itself.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from etcd_testbed.server import free_port
from tests.support.tools import needs_tool

REPO = Path(__file__).resolve().parents[2]
PLAIN_DDP = REPO / "tests" / "chaos" / "scripts" / "plain_ddp_steps.py"
TORCHRUN = ["-m", "torch.distributed.run"]
# the scripts here never import torch: their warm workers need not either (the warm path is the same)
ELASTIC_RT = ["-m", "elastic_rt.cli", "launch", "--metrics-port", "0", "--warm-imports", ""]

LINES = textwrap.dedent("""
    import os, sys
    r = os.environ["LOCAL_RANK"]
    print(f"rank {r} apple out", flush=True)
    print(f"rank {r} banana out", flush=True)
    print(f"rank {r} pear err", file=sys.stderr, flush=True)
    print(f"rank {r} role={os.environ['ROLE_NAME']} main={__name__}", flush=True)
""")

DUMP = textwrap.dedent("""
    import json, os, sys
    def allowed(path):
        with open(path) as f:
            return next(l.split(":", 1)[1].strip() for l in f if l.startswith("Cpus_allowed_list"))
    threads = sorted({allowed(f"/proc/self/task/{t}/status") for t in os.listdir("/proc/self/task")})
    keys = ("RANK", "LOCAL_RANK", "CUDA_VISIBLE_DEVICES", "ROLE_NAME", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
    out = {"env": {k: os.environ.get(k) for k in keys}, "cpus": allowed("/proc/self/status"), "threads": threads}
    with open(os.path.join(sys.argv[1], "rank-%s.json" % os.environ["RANK"]), "w") as f:
        json.dump(out, f)
""")

# A LogsSpecs of the user's, registered in the torchrun.logs_specs entry point group by an installed
# distribution (a dist-info directory on the path is what pip leaves behind).
SPECS = textwrap.dedent("""
    import os
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

    class MarkedLogsSpecs(DefaultLogsSpecs):
        def reify(self, envs):
            dest = super().reify(envs)
            with open(os.path.join(self.root_log_dir, "reified-by-marked-specs"), "a") as f:
                f.write(f"{len(envs)} ranks\\n")
            return dest
""")


def _install_specs(root: Path) -> Path:
    root.mkdir()
    (root / "ert_marked_specs.py").write_text(SPECS)
    info = root / "ert_marked_specs-0.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ert-marked-specs\nVersion: 0.0\n")
    (info / "entry_points.txt").write_text("[torchrun.logs_specs]\nmarked = ert_marked_specs:MarkedLogsSpecs\n")
    return root


def _environ(*paths: Path, **extra: str) -> dict[str, str]:
    """The parent environment both launchers get: none of their own variables, these paths first."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("PET_", "TORCHELASTIC_", "ELASTIC_RT_", "TORCH_ELASTIC_"))
           and k not in ("OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "TORCH_DISABLE_SHARE_RDZV_TCP_STORE")}
    env["PYTHONPATH"] = os.pathsep.join([*(str(p) for p in paths), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**env, **extra}


class Run:
    """One launcher process; stdout and stderr go to files (no pipe to fill while another run goes on)."""

    def __init__(self, name: str, argv: list[str], cwd: Path, env: dict[str, str]) -> None:
        self.name, self.out, self.err = name, cwd / f"{name}.out", cwd / f"{name}.err"
        with open(self.out, "w") as out, open(self.err, "w") as err:
            self.proc = subprocess.Popen([sys.executable, *argv], cwd=cwd, env=env, stdout=out, stderr=err)

    def wait(self, timeout_s: float = 600) -> tuple[str, str]:
        try:
            code = self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise
        stdout, stderr = self.out.read_text(), self.err.read_text()
        assert code == 0, f"{self.name} exited {code}:\n{stdout[-3000:]}\n{stderr[-5000:]}"
        return stdout, stderr


def _console(text: str, prefix: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith(prefix)]


def _events(stderr: str) -> list[tuple]:
    found = []
    for line in stderr.splitlines():
        if line.startswith('{"name": "torchelastic.'):
            event = json.loads(line)
            md = event["metadata"]
            found.append((event["name"], event["source"], md.get("state"), md.get("role"), md.get("global_rank")))
    return sorted(found, key=repr)


def _attempt_files(log_dir: Path) -> dict[str, str]:
    """The run-level files a launcher wrote under --log-dir: the marker and attempt 0's filtered logs."""
    attempts = glob.glob(str(log_dir / "*" / "attempt_0"))
    assert len(attempts) == 1, f"expected one run directory with attempt_0 under {log_dir}: {attempts}"
    files = {name: (Path(attempts[0]) / name).read_text() for name in ("filtered_stdout.log", "filtered_stderr.log")}
    files["marker"] = (log_dir / "reified-by-marked-specs").read_text()
    return files


@pytest.mark.timeout(900)
def test_console_lines_filter_files_logs_specs_and_events_match_torchrun(tmp_path):
    script = tmp_path / "lines.py"
    script.write_text(LINES)
    env = _environ(_install_specs(tmp_path / "site"))
    flags = ["--standalone", "--nproc-per-node", "2", "--tee", "3", "--local-ranks-filter", "1", "--role", "trainer",
             "--duplicate-stdout-filters", "apple,banana", "--duplicate-stderr-filters", "pear",
             "--logs-specs", "marked", "--event-log-handler", "console", "--run-path", "--start-method", "fork"]
    for name in ("torchrun", "elastic-rt"):
        (tmp_path / f"logs-{name}").mkdir()
    runs = {}
    for name, extra in (("torchrun", TORCHRUN), ("elastic-rt", ELASTIC_RT)):
        runs[name] = Run(name, [*extra, *flags, "--log-dir", str(tmp_path / f"logs-{name}"), str(script)], tmp_path, env)
    (t_out, t_err), (e_out, e_err) = runs["torchrun"].wait(), runs["elastic-rt"].wait()

    assert _console(t_out, "[trainer") == ["[trainer1]:rank 1 apple out", "[trainer1]:rank 1 banana out",
                                           "[trainer1]:rank 1 role=trainer main=__main__"]  # the premise
    assert _console(e_out, "[trainer") == _console(t_out, "[trainer")
    assert _console(e_err, "[trainer") == _console(t_err, "[trainer") == ["[trainer1]:rank 1 pear err"]
    theirs, ours = _attempt_files(tmp_path / "logs-torchrun"), _attempt_files(tmp_path / "logs-elastic-rt")
    assert theirs == {"filtered_stdout.log": "[trainer1]:rank 1 apple out\n[trainer1]:rank 1 banana out\n",
                      "filtered_stderr.log": "[trainer1]:rank 1 pear err\n", "marker": "2 ranks\n"}
    assert ours == theirs
    assert _events(e_err) == _events(t_err)
    assert ("torchelastic.worker.status.SUCCEEDED", "WORKER", "SUCCEEDED", "trainer", 1) in _events(t_err)
    assert "--start-method fork: workers are new processes" in e_err  # explained at start, not dropped


def _dumps(directory: Path) -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(directory.glob("rank-*.json"))}


@needs_tool("numactl", shutil.which("numactl") is not None, "apt-get install numactl")
@pytest.mark.timeout(900)
def test_numa_binding_and_virtual_local_rank_match_torchrun_warm_and_cold(tmp_path):
    script = tmp_path / "dump.py"
    script.write_text(DUMP)
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: exclusive binding then gives each of 2 local ranks its own")
    env = _environ(NUMA_SHIM_GPUS="2", CUDA_VISIBLE_DEVICES="4,6")
    flags = ["--standalone", "--nproc-per-node", "2", "--numa-binding", "exclusive", "--virtual-local-rank"]
    out = {name: tmp_path / name for name in ("torchrun", "elastic-rt", "elastic-rt1")}
    for d in out.values():
        d.mkdir()
    runs = [Run("torchrun", ["-m", "tests.support.numa_shim", *TORCHRUN[1:], *flags, str(script), str(out["torchrun"])],
                tmp_path, env)]
    for name, warm in (("elastic-rt", "on"), ("elastic-rt1", "off")):
        runs.append(Run(name, ["-m", "tests.support.numa_shim", *ELASTIC_RT[1:], "--warm-workers", warm, *flags,
                               str(script), str(out[name])], tmp_path, env))
    logs = {run.name: run.wait() for run in runs}
    theirs = _dumps(out["torchrun"])
    assert theirs["rank-0.json"]["env"]["CUDA_VISIBLE_DEVICES"] == "4"  # the premise: torchrun's behaviour
    assert theirs["rank-1.json"]["env"]["LOCAL_RANK"] == "0"
    assert theirs["rank-0.json"]["cpus"] != theirs["rank-1.json"]["cpus"]  # exclusive: a CPU each
    assert _dumps(out["elastic-rt"]) == theirs  # warm workers: bound by elastic-rt, every thread
    assert _dumps(out["elastic-rt1"]) == theirs  # cold workers: bound by torch (numactl)
    assert "started local rank(s) 0,1 from warm workers" in logs["elastic-rt"][1]
    assert "local rank 0 on CPUs" in logs["elastic-rt"][1]


@pytest.mark.timeout(900)
def test_static_rendezvous_runs_a_ddp_job_on_two_agents(tmp_path):
    """torchrun's static command line, --rdzv-backend left out (torchrun's default is static)."""
    port = free_port()
    env = _environ()
    nodes = [Run(f"node{rank}", [*ELASTIC_RT, "--warm-workers", "off", "--nnodes", "2", "--nproc-per-node", "1",
                                 "--node-rank", str(rank),
                                 "--master-addr", "127.0.0.1", "--master-port", str(port), "--tee", "3",
                                 str(PLAIN_DDP), "--steps", "3"], tmp_path, env) for rank in (0, 1)]
    (out0, err0), (_, err1) = nodes[0].wait(), nodes[1].wait()
    assert "[default0]:done steps=3 world_size=2" in out0
    for err in (err0, err1):
        assert "--node-rank, --master-addr, --master-port without --rdzv-backend: torchrun's static rendezvous" in err
        assert "job finished" in err
