"""Warm workers: the pure rules (which variables wait for the rendezvous, when a warm worker is unusable)."""

from __future__ import annotations

import os

import pytest

from elastic_rt.agent.warm import (
    PAD_BYTES,
    WORKER_MODULE,
    incompatibility,
    is_late,
    warm_command,
    warm_environment,
    WarmSettings,
)
from elastic_rt.worker.warm_child import ENV_PAD, split_argv
from elastic_rt.launch_config import launch_config_from_args
from elastic_rt.cli import build_parser
from elastic_rt.errors import ConfigError
from elastic_rt.worker_env import ENV_PARENT_PID, ENV_ROUND

COLD = ("-u", "-m", WORKER_MODULE, "--", "train.py", "--lr", "0.1")


@pytest.mark.parametrize("key", ["RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK", "TORCHELASTIC_RESTART_COUNT",
                                 "TORCHELASTIC_ERROR_FILE", ENV_ROUND])
def test_rendezvous_variables_are_late(key):
    assert is_late(key)


@pytest.mark.parametrize("key", ["PATH", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONPATH", ENV_PARENT_PID])
def test_startup_variables_are_not_late(key):
    assert not is_late(key)


def test_warm_environment_drops_late_variables_and_ends_with_the_pad():
    env = warm_environment({"PATH": "/bin", "RANK": "3", "OMP_NUM_THREADS": "1", ENV_PAD: "old"}, 42)
    assert "RANK" not in env and env["PATH"] == "/bin" and env["OMP_NUM_THREADS"] == "1"
    assert env[ENV_PARENT_PID] == "42"
    assert list(env)[-1] == ENV_PAD and len(env[ENV_PAD]) == PAD_BYTES


def test_a_warm_worker_fits_when_only_rendezvous_variables_are_added():
    initial = warm_environment({"PATH": "/bin"}, 42)
    final = {"PATH": "/bin", ENV_PARENT_PID: "42", "RANK": "1", "MASTER_ADDR": "10.0.0.1"}
    assert incompatibility(initial, final) is None


@pytest.mark.parametrize("final, words", [
    ({"PATH": "/usr/bin", ENV_PARENT_PID: "42"}, "PATH changed"),
    ({ENV_PARENT_PID: "42"}, "PATH was unset"),
    ({"PATH": "/bin", ENV_PARENT_PID: "42", "OMP_NUM_THREADS": "4"}, "OMP_NUM_THREADS was set"),
    ({"PATH": "/bin", ENV_PARENT_PID: "42", "RANK": "x" * (PAD_BYTES + 100)}, "outgrew"),
])
def test_any_other_change_makes_the_warm_worker_unusable(final, words):
    why = incompatibility(warm_environment({"PATH": "/bin"}, 42), final)
    assert why is not None and words in why


def test_warm_command_is_the_cold_one_with_the_warm_flags_and_round_trips():
    cmd = warm_command("/py", COLD, fd=5, ready_fd=6, nice=10, imports=("torch", "numpy"))
    assert cmd[:4] == ["/py", "-u", "-m", WORKER_MODULE] and cmd[-4:] == list(COLD[3:])
    opts, rest = split_argv(cmd[4:])
    assert (opts.fd, opts.ready_fd, opts.nice, opts.imports) == (5, 6, 10, ("torch", "numpy"))
    assert rest == list(COLD[3:])


def test_only_the_worker_entry_point_can_be_warmed():
    assert warm_command("/py", ("-u", "-m", "other", "--", "x.py"), fd=5, ready_fd=6, nice=0, imports=()) is None
    assert warm_command("/bin/train", (), fd=5, ready_fd=6, nice=0, imports=()) is None


def test_cold_argv_is_left_alone():
    assert split_argv(["--", "train.py"]) == (None, ["--", "train.py"])


def _cfg(*flags: str):
    return launch_config_from_args(build_parser().parse_args(["launch", "--standalone", *flags, "train.py"]))


def _warm(*flags: str) -> WarmSettings:
    return _cfg(*flags).section(WarmSettings)


def test_warm_flags():
    assert _warm().enabled is True and "torch" in _warm().imports
    assert _warm("--warm-workers", "off").enabled is False
    assert _warm("--warm-imports", "torch, numpy").imports == ("torch", "numpy")
    with pytest.raises(ConfigError, match="--warm-imports"):
        _cfg("--warm-imports", "torch;rm -rf")


def test_standby_and_warm_worker_gauges():
    from prometheus_client import CollectorRegistry

    from elastic_rt.metrics.definitions import AgentMetrics

    reg = CollectorRegistry()
    m = AgentMetrics(registry=reg, run_id="job7", node="node-a", sysfs_root=None, timex_reader=None)
    base = {"run_id": "job7", "node": "node-a"}
    m.on_rendezvous_started()
    assert reg.get_sample_value("elastic_rt_standby", base) == 1
    m.on_rendezvous(round=1, world_size=2, nodes=1, duration_s=0.5)
    assert reg.get_sample_value("elastic_rt_standby", base) == 0
    ready = [2]
    m.track_warm_workers(lambda: ready[0])
    assert reg.get_sample_value("elastic_rt_warm_workers_ready", base) == 2
    ready[0] = 0
    assert reg.get_sample_value("elastic_rt_warm_workers_ready", base) == 0


def test_host_cache_directories_of_dead_agents_are_removed(tmp_path, monkeypatch):
    import subprocess
    import sys

    from elastic_rt.agent.host_memory import (HOST_CACHE_OWNER, HostMemorySettings, make_host_cache,
                                             remove_stale_host_caches)

    monkeypatch.setenv("ELASTIC_RT_HOST_CACHE_DIR", "")  # restored after the test: make_host_cache sets it
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    for name, owner in (("elastic-rt-a-n1", f"{dead.pid} 1.000"), ("elastic-rt-b-n1", None), ("other", "1 1")):
        (tmp_path / name).mkdir()
        if owner:
            (tmp_path / name / HOST_CACHE_OWNER).write_text(owner)
    mine = make_host_cache(_cfg(), "node-a", shm_root=str(tmp_path))  # the live one: this process
    assert mine is not None and os.path.isdir(mine)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["elastic-rt-b-n1", "other", os.path.basename(mine)])  # the dead agent's went, unknown ones stay
    assert remove_stale_host_caches(str(tmp_path)) == []  # this agent's own is not stale
    assert _cfg("--host-cache", "off").section(HostMemorySettings).host_cache is False
