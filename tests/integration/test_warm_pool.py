"""WarmPool with real processes (no torch): a start message turns a warm worker into the worker a cold
start would have made; anything doubtful is refused or runs cold; warm workers die with their agent."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import psutil
import pytest

from elastic_rt.agent.warm import WORKER_MODULE, WarmPool
from elastic_rt.worker_env import ENV_PARENT_PID

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = textwrap.dedent("""
    import json, os, sys, time
    import colorsys
    go = sys.argv[1]
    print(json.dumps({"pid": os.getpid(), "argv": sys.argv[1:], "rank": os.environ.get("RANK"),
                      "pad": "ELASTIC_RT_WARM_PAD" in os.environ, "colorsys": colorsys.__file__,
                      "nice": os.nice(0)}), flush=True)
    deadline = time.monotonic() + 60
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.02)
""")


def _poll(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise TimeoutError(f"no {what} within {timeout_s} s")


def _read(path: Path) -> str:
    return path.read_text().strip() if path.exists() else ""


@pytest.fixture
def job(tmp_path):
    script = tmp_path / "job" / "train.py"
    script.parent.mkdir()
    script.write_text(SCRIPT)
    # the agent's environment when it starts workers (it sets its own pid there)
    environ = dict(os.environ, PYTHONPATH=str(ROOT), **{ENV_PARENT_PID: str(os.getpid())})
    pools: list[WarmPool] = []

    def make(imports=("colorsys",), ready=True) -> WarmPool:
        pool = WarmPool(entrypoint=sys.executable, nproc=1, imports=imports, environ=environ,
                        args_for_rank=lambda r: ("-u", "-m", WORKER_MODULE, "--", str(script), str(tmp_path / "go")))
        pools.append(pool)
        pool.start()
        _poll(lambda: pool.idle_pids(ready_only=ready), 60, "ready warm worker" if ready else "warm worker")
        return pool

    yield make, script, environ, tmp_path
    (tmp_path / "go").touch()
    for pool in pools:
        pool.close()


def _take(pool: WarmPool, script: Path, tmp_path: Path, env: dict, **extra):
    out = tmp_path / "stdout.log"
    proc, why = pool.take(0, entrypoint=sys.executable,
                          args=("-u", "-m", WORKER_MODULE, "--", str(script), str(tmp_path / "go")),
                          env=env, stdout=str(out), stderr=str(tmp_path / "stderr.log"), **extra)
    return proc, why, out


def test_started_warm_worker_is_the_worker_a_cold_start_makes(job):
    make, script, environ, tmp_path = job
    pool = make()
    warm_pid = pool.idle_pids()[0]
    proc, why, out = _take(pool, script, tmp_path, {"RANK": "5", "LOCAL_RANK": "0", "WORLD_SIZE": "8"})
    assert why == "" and proc.pid == warm_pid
    line = json.loads(_poll(lambda: _read(out), 30, "script output"))
    assert line["pid"] == warm_pid and line["rank"] == "5" and line["pad"] is False
    assert line["argv"] == [str(tmp_path / "go")]
    assert line["nice"] == os.nice(0)  # niced while importing ahead (where it can be undone), not after
    # what tools see in /proc (ps e, elastic-rt chaos, benchmarks): the worker's variables, no pad
    seen = psutil.Process(warm_pid).environ()
    assert seen["RANK"] == "5" and seen["WORLD_SIZE"] == "8" and "ELASTIC_RT_WARM_PAD" not in seen
    assert seen["PATH"] == environ["PATH"]
    (tmp_path / "go").touch()
    assert proc.wait(timeout=30) == 0


HELD_IMPORT = textwrap.dedent("""
    import os, sys, time
    deadline = time.monotonic() + 60
    while not os.path.exists(os.environ["HELD_IMPORT_GO"]) and time.monotonic() < deadline:
        time.sleep(0.02)
    print("written while importing", flush=True)
    print("warned while importing", file=sys.stderr, flush=True)
""")


def _held_pool(job) -> WarmPool:
    """A pool whose warm worker stays inside its imports until `imported` exists in the job's folder."""
    make, _, environ, tmp_path = job
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "held_import.py").write_text(HELD_IMPORT)
    environ.update(PYTHONPATH=f"{ROOT}{os.pathsep}{mods}", HELD_IMPORT_GO=str(tmp_path / "imported"))
    return make(imports=("held_import",), ready=False)


@pytest.mark.parametrize("redirected", [True, False], ids=["to-log-files", "not-redirected"])
def test_output_of_a_worker_started_while_importing_goes_where_a_cold_workers_would(job, capfd, redirected):
    make, script, environ, tmp_path = job
    pool = _held_pool(job)
    warm_pid = pool.idle_pids()[0]
    out, err = tmp_path / "stdout.log", tmp_path / "stderr.log"
    proc, why = pool.take(0, entrypoint=sys.executable,
                          args=("-u", "-m", WORKER_MODULE, "--", str(script), str(tmp_path / "go")), env={"RANK": "0"},
                          stdout=str(out) if redirected else "", stderr=str(err) if redirected else "")
    assert proc.pid == warm_pid and why == "still importing"  # held inside its imports
    (tmp_path / "imported").touch()
    (tmp_path / "go").touch()
    assert proc.wait(timeout=60) == 0
    if redirected:  # the rank's files hold everything, in order; none of it reached the agent's console
        assert out.read_text().splitlines()[0] == "written while importing"
        assert json.loads(out.read_text().splitlines()[1])["pid"] == warm_pid
        assert err.read_text() == "warned while importing\n"
        console = capfd.readouterr()
        assert "while importing" not in console.out + console.err
    else:  # on the inherited streams, as a cold worker's output would be
        console = capfd.readouterr()
        assert "written while importing" in console.out and "warned while importing" in console.err


def test_a_changed_environment_is_refused_and_the_warm_worker_discarded(job):
    make, script, environ, tmp_path = job
    pool = make()
    warm_pid = pool.idle_pids()[0]
    environ["OMP_NUM_THREADS"] = "7"  # the agent's environment changed after the warm worker started
    proc, why, _ = _take(pool, script, tmp_path, {"RANK": "0"})
    assert proc is None and "OMP_NUM_THREADS was set" in why
    assert not psutil.pid_exists(warm_pid) or psutil.Process(warm_pid).status() == psutil.STATUS_ZOMBIE


def test_another_command_is_refused(job):
    make, script, environ, tmp_path = job
    pool = make()
    proc, why = pool.take(0, entrypoint=sys.executable, args=("-u", "-m", WORKER_MODULE, "--", "other.py"),
                          env={}, stdout="", stderr="")
    assert proc is None and "command differs" in why


def test_script_directory_shadowing_an_imported_module_runs_cold(job):
    make, script, environ, tmp_path = job
    (script.parent / "colorsys.py").write_text("")  # the script's own colorsys: cold would import it
    pool = make(imports=("colorsys",))
    warm_pid = pool.idle_pids()[0]
    proc, why, out = _take(pool, script, tmp_path, {"RANK": "0"})
    assert proc.pid == warm_pid
    line = json.loads(_poll(lambda: _read(out), 60, "script output"))
    assert line["colorsys"] == str(script.parent / "colorsys.py")  # as cold: the script's module
    assert line["pid"] == warm_pid  # executed in place
    assert "starting cold" in (tmp_path / "stderr.log").read_text()


def test_closing_the_pool_stops_idle_warm_workers(job):
    make, *_ = job
    pool = make()
    pid = pool.idle_pids()[0]
    pool.close()
    assert not psutil.pid_exists(pid)


AGENT = textwrap.dedent("""
    import os, sys, time
    from elastic_rt.agent.warm import WORKER_MODULE, WarmPool
    pool = WarmPool(entrypoint=sys.executable, nproc=2, imports=(), environ=os.environ,
                    args_for_rank=lambda r: ("-u", "-m", WORKER_MODULE, "--", "train.py"))
    pool.start()
    while len(pool.idle_pids(ready_only=True)) < 2:
        time.sleep(0.05)
    print(*pool.idle_pids().values(), flush=True)
    time.sleep(120)
""")


def test_warm_workers_die_with_a_sigkilled_agent(tmp_path):
    agent = subprocess.Popen([sys.executable, "-c", AGENT], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                             env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        pids = [int(p) for p in agent.stdout.readline().split()]
        assert len(pids) == 2
        warm = [psutil.Process(p) for p in pids]
        os.kill(agent.pid, signal.SIGKILL)
        agent.wait(timeout=30)
        _, alive = psutil.wait_procs(warm, timeout=30)
        assert not alive
    finally:
        agent.kill()


def test_the_pool_is_warming_from_a_refill_request_until_its_worker_has_imported(job):
    """What a running node's scale-up waits for (agent/scale_up.py): a requested refill, then a warm worker
    still inside its imports; not a ready warm worker, and not a pool whose refill waits on nothing."""
    make, script, environ, tmp_path = job
    pool = _held_pool(job)
    assert pool.warming()  # held inside its imports
    (tmp_path / "imported").touch()
    _poll(lambda: pool.idle_pids(ready_only=True), 60, "ready warm worker")
    assert not pool.warming()
    proc, why, _ = _take(pool, script, tmp_path, {"RANK": "0"})
    assert why == ""
    gate = threading.Event()
    pool.refill(ready=gate.is_set)  # the refill waits for the new workers (up to refill_wait_s)
    assert pool.warming()
    gate.set()
    _poll(lambda: pool.idle_pids(ready_only=True), 60, "ready refilled warm worker")
    assert not pool.warming()
    (tmp_path / "go").touch()
    assert proc.wait(timeout=30) == 0
