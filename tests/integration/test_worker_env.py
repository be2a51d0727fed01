"""Workers started by `elastic-rt launch` get torchrun's environment, variable for variable.

A plain script (no elastic_rt import) dumps os.environ from every worker, once under
`torchrun --standalone` and once under `elastic-rt launch --standalone`, from the same directory
with the same parent environment; the two dumps of each local rank are diffed. The only
differences allowed are the ones listed below (docs/worker-environment.md explains each).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from elastic_rt.worker_env import OMP_DEFAULT_WARNING

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Variables only elastic-rt's workers have.
EXTRA_PREFIXES = ("ELASTIC_RT_",)  # elastic-rt's own (worker_env.py)
EXTRA_KEYS = {
    # set by the launcher for torch's rendezvous handlers (a fresh worker store per restart);
    # the agent reads it at every rendezvous, so it stays in the environment workers inherit
    "TORCH_DISABLE_SHARE_RDZV_TCP_STORE",
}
# Variables both have, with values that are naturally per run or follow from the key above.
PER_RUN_VALUES = {
    "MASTER_PORT",                # a free port picked by each run
    "TORCHELASTIC_RUN_ID",        # torchrun: a random uuid; elastic-rt: standalone-<random>
    "TORCHELASTIC_ERROR_FILE",    # under each run's own log directory
    "TORCHELASTIC_USE_AGENT_STORE",  # "False" under elastic-rt: see TORCH_DISABLE_SHARE_RDZV_TCP_STORE
}

DUMP = """\
import json, os, sys
with open(os.path.join(sys.argv[1], "env-%s.json" % os.environ["LOCAL_RANK"]), "w") as f:
    json.dump(dict(os.environ), f)
"""


def _run(cmd: list[str], cwd, env: dict[str, str]) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{cmd[2]} exited {proc.returncode}:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout + proc.stderr


def _dumps(out_dir, nproc: int) -> dict[int, dict[str, str]]:
    envs = {}
    for rank in range(nproc):
        with open(os.path.join(out_dir, f"env-{rank}.json")) as f:
            envs[rank] = json.load(f)
    return envs


def run_both(tmp_path, nproc: int, user_env: dict[str, str]):
    """Run the dump script under both launchers; returns (torchrun envs, elastic-rt envs, outputs)."""
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP)
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS" and not k.startswith(
        ("TORCHELASTIC_", "ELASTIC_RT_", "PET_")) and k != "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"}
    env.update(user_env, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    common = ["--standalone", "--nproc-per-node", str(nproc), "--max-restarts", "3"]
    outputs, envs = {}, {}
    for name, launcher in (("torchrun", ["-m", "torch.distributed.run"]),
                           ("elastic-rt", ["-m", "elastic_rt.cli", "launch", "--metrics-port", "0"])):
        out_dir = tmp_path / name
        out_dir.mkdir()
        outputs[name] = _run([sys.executable, *launcher, *common, str(script), str(out_dir)], tmp_path, env)
        envs[name] = _dumps(out_dir, nproc)
    return envs["torchrun"], envs["elastic-rt"], outputs


def assert_same_contract(torchrun: dict[str, str], ert: dict[str, str], rank: int) -> None:
    missing = sorted(set(torchrun) - set(ert))
    assert not missing, f"local rank {rank}: torchrun sets {missing}, elastic-rt does not"
    extra = sorted(k for k in set(ert) - set(torchrun) if not k.startswith(EXTRA_PREFIXES) and k not in EXTRA_KEYS)
    assert not extra, f"local rank {rank}: elastic-rt sets {extra}, torchrun does not"
    differ = {k: (torchrun[k], ert[k]) for k in set(torchrun) & set(ert)
              if torchrun[k] != ert[k] and k not in PER_RUN_VALUES}
    assert not differ, f"local rank {rank}: values differ (torchrun, elastic-rt): {differ}"
    # the per-run values are still of the same kind
    for env in (torchrun, ert):
        assert env["MASTER_PORT"].isdigit()
        assert env["TORCHELASTIC_ERROR_FILE"].endswith(os.path.join("attempt_0", str(rank), "error.json"))
        assert env["TORCHELASTIC_RUN_ID"]
    assert ert["TORCHELASTIC_USE_AGENT_STORE"] == ("False" if ert.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE") == "1"
                                                   else torchrun["TORCHELASTIC_USE_AGENT_STORE"])
    for key in ("ELASTIC_RT_AGENT_PID", "ELASTIC_RT_HEARTBEAT_FILE", "ELASTIC_RT_RUN_ID", "ELASTIC_RT_ROUND"):
        assert ert.get(key), f"elastic-rt's own {key} is missing"
    assert ert["ELASTIC_RT_RUN_ID"] == ert["TORCHELASTIC_RUN_ID"]


@pytest.mark.timeout(1500)  # two launcher runs; generous for a loaded machine
@pytest.mark.parametrize("nproc,user_env,omp", [
    (2, {}, "1"),                          # several workers, nothing set: both default to 1 and warn
    (1, {}, None),                         # one worker: nothing set, no warning
    # the user's value is kept, no warning: the rule is tests/unit/test_config.py's; long for CI's time
    pytest.param(2, {"OMP_NUM_THREADS": "3"}, "3", marks=pytest.mark.long),
], ids=["nproc2", "nproc1", "nproc2-user-omp3"])
def test_worker_environment_matches_torchrun(tmp_path, nproc, user_env, omp):
    torchrun, ert, outputs = run_both(tmp_path, nproc, user_env)
    for rank in range(nproc):
        assert_same_contract(torchrun[rank], ert[rank], rank)
        assert torchrun[rank].get("OMP_NUM_THREADS") == omp  # the premise: torchrun's rule
        assert ert[rank].get("OMP_NUM_THREADS") == omp
        assert ert[rank]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
        assert ert[rank]["LOCAL_RANK"] == str(rank) and ert[rank]["WORLD_SIZE"] == str(nproc)
    warned = 1 if user_env == {} and nproc > 1 else 0
    assert outputs["torchrun"].count(OMP_DEFAULT_WARNING) == warned
    assert outputs["elastic-rt"].count(OMP_DEFAULT_WARNING) == warned


@pytest.mark.timeout(900)
def test_signals_to_handle_flag_reaches_workers(tmp_path):
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    _run([sys.executable, "-m", "elastic_rt.cli", "launch", "--standalone", "--nproc-per-node", "1",
          "--metrics-port", "0", "--signals-to-handle", "SIGTERM,SIGUSR1", str(script), str(tmp_path)],
         tmp_path, env)
    assert _dumps(tmp_path, 1)[0]["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"


def test_the_etcd_password_never_reaches_the_workers(tmp_path, etcd_endpoint, run_id):
    """$ELASTIC_RT_ETCD_PASSWORD is the agent's: it leaves the agent's environment as it is read, before any worker
    (warm ones included) is started, so the script, its DataLoader workers and trackers never see it."""
    script = tmp_path / "dump_env.py"
    script.write_text(DUMP)
    env = dict(os.environ, ELASTIC_RT_ETCD_PASSWORD="s3cret-pw",
               PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    _run([sys.executable, "-m", "elastic_rt.cli", "launch", "--nnodes", "1", "--nproc-per-node", "2",
          "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id, "--local-addr", "127.0.0.1", "--metrics-port", "0",
          str(script), str(tmp_path)], tmp_path, env)
    for rank, worker_env in _dumps(tmp_path, 2).items():
        assert "ELASTIC_RT_ETCD_PASSWORD" not in worker_env, rank
        assert "s3cret-pw" not in json.dumps(worker_env), rank
