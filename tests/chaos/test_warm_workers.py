"""Warm workers end to end: a killed worker's group restarts from pre-started processes and trains
exactly what a run without failure trains; the agent's death takes every warm process with it."""

from __future__ import annotations

import os
import signal
import stat
import time

import psutil
import pytest

from tests.chaos.harness import EXAMPLE, ROOT, Node, launch_args
from tests.chaos.test_launch_e2e import _rank0, nodes  # noqa: F401 - fixture
from tests.chaos.test_resume_e2e import _committed_indices
from tests.integration.test_warm_pool import HELD_IMPORT, _poll

pytestmark = pytest.mark.slow

READY = r"warm workers ready for local rank\(s\) 0,1"


def _standalone(*job: str, extra: list[str] | None = None, script: str = EXAMPLE) -> list[str]:
    return ["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3", *(extra or []),
            script, *job]


def _after_first_step(n: Node) -> float:
    """Monotonic time of the first step line: warm workers are refilled after the first step."""
    n.wait_for(r"\]:step=1 ", 240)
    return min(t for t, line in n.lines if "]:step=1 " in line)


def test_killed_worker_is_replaced_by_a_warm_one_and_trains_the_same(tmp_path, nodes):  # noqa: F811
    job = ["--steps", "100", "--save-every", "10", "--dataset-size", "200", "--batch-size", "4", "--log-indices"]
    n = Node(_standalone(*job, "--ckpt-url", f"file://{tmp_path}/run", "--step-sleep", "0.25"), name="run")
    nodes.append(n)
    n.wait_for(r"started local rank\(s\) 0,1 from warm workers", 240)
    n.wait_for(READY, 240, after=_after_first_step(n))  # the refill, after the first step
    workers = _poll(lambda: _running(n), 60, "two running workers and two idle warm ones")
    idle = {p: psutil.Process(p).create_time() for p in n.warm_pids()}
    victim = workers["1"]
    t_kill, wall_kill = time.monotonic(), time.time()
    os.kill(victim, signal.SIGKILL)
    n.wait_for(r"started local rank\(s\) 0,1 from warm workers$", 120, after=t_kill)  # ready, not importing
    n.wait_for(r"\]:start step=\d+ world_size=2 .*restart=1", 120, after=t_kill)
    assert set(n.worker_pids()) == set(idle)  # the new workers are the processes started before the kill
    assert all(created < wall_kill for created in idle.values())
    # the run without failure trains while the restarted group sleeps through its steps (its own processes,
    # checkpoints and store: nothing is shared but the CPUs)
    ref = Node(_standalone(*job, "--ckpt-url", f"file://{tmp_path}/ref", "--step-sleep", "0",
                           extra=["--warm-workers", "off"]), name="reference")
    nodes.append(ref)
    assert ref.wait_exit(300) == 0, ref.output[-3000:]
    ref_digest = ref.matches(r"done steps=100 world_size=2 param_digest=(\w+)")[0].group(1)
    assert n.wait_exit(300) == 0, n.output[-3000:]
    assert n.matches(r"done steps=100 world_size=2 param_digest=(\w+)")[-1].group(1) == ref_digest
    committed = _committed_indices([n])
    assert sorted(committed) == list(range(1, 101))
    for epoch in range(4):  # 25 steps of 8 samples per epoch: every sample once per epoch
        samples = [i for _, (e, idx) in committed.items() if e == epoch for i in idx]
        assert sorted(samples) == list(range(200)), f"epoch {epoch}"


def _running(n: Node) -> dict[str, int] | None:
    """LOCAL_RANK -> pid of the two workers, once they run beside two idle warm workers."""
    try:
        workers = {psutil.Process(p).environ().get("LOCAL_RANK"): p for p in n.worker_pids()}
    except psutil.NoSuchProcess:
        return None
    return workers if set(workers) == {"0", "1"} and len(n.warm_pids()) == 2 else None


def test_sigkilled_agent_leaves_no_warm_process_behind(nodes):  # noqa: F811
    n = Node(_standalone("--steps", "100000", "--step-sleep", "0.1"), name="agent")
    nodes.append(n)
    n.wait_for(READY, 240, after=_after_first_step(n))
    _poll(lambda: _running(n), 60, "two running workers and two idle warm ones")
    tree = psutil.Process(n.proc.pid).children(recursive=True)
    os.kill(n.proc.pid, signal.SIGKILL)  # the agent only: its children must follow it
    _, alive = psutil.wait_procs(tree, timeout=60)
    assert not alive, [p.pid for p in alive]


def test_workers_started_while_importing_keep_all_their_console_output(tmp_path, nodes):  # noqa: F811
    # the warm workers' imports are held open until the agent has handed them their ranks: what they
    # print while importing and afterwards reaches the console through --tee, with the rank prefix
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "held_import.py").write_text(HELD_IMPORT)
    go = tmp_path / "imported"
    n = Node(_standalone("--steps", "3", extra=["--warm-imports", "held_import,torch"]), name="held",
             env={"PYTHONPATH": f"{ROOT}{os.pathsep}{mods}", "HELD_IMPORT_GO": str(go)})
    nodes.append(n)
    n.wait_for(r"started local rank\(s\) 0,1 from warm workers \(0,1 still importing\)", 240)
    go.touch()
    assert n.wait_exit(300) == 0, n.output[-3000:]
    for stream in ("written", "warned"):
        assert sorted(m.group(1) for m in n.matches(rf"^\[default(\d)\]:{stream} while importing$")) == ["0", "1"]
        assert len(n.matches(f"{stream} while importing")) == 2  # nothing unprefixed (refills print nowhere)
    assert n.matches(r"^\[default0\]:done steps=3 world_size=2")


def test_module_mode_runs_from_warm_workers(nodes):  # noqa: F811
    n = Node(["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3",
              "-m", "launch.train_example", "--steps", "3"], name="module")
    nodes.append(n)
    assert n.wait_exit(300) == 0, n.output[-3000:]
    assert n.matches(r"started local rank\(s\) 0,1 from warm workers")
    assert n.matches(r"done steps=3 world_size=2")


def test_no_python_runs_cold(tmp_path, nodes):  # noqa: F811
    script = tmp_path / "job.sh"
    script.write_text("#!/bin/sh\necho \"shell worker rank=$RANK of $WORLD_SIZE\"\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    n = Node(["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3", "--no-python",
              str(script)], name="no-python")
    nodes.append(n)
    assert n.wait_exit(120) == 0, n.output[-3000:]
    assert n.matches(r"warm workers off: --no-python")
    assert sorted(m.group(1) for m in n.matches(r"shell worker rank=(\d) of 2")) == ["0", "1"]
    assert not n.matches(r"from warm workers")


@pytest.mark.long  # for CI's time: a waiting node joins the next round in test_handler.py; node loss: test_launch_e2e
def test_hot_spare_takes_the_place_of_a_killed_node(etcd_endpoint, run_id, nodes):  # noqa: F811
    started = {name: Node(launch_args(etcd_endpoint, run_id, name, nnodes="1:2", nproc=1, steps=150,
                                      step_sleep=0.1), name=name) for name in ("a", "b", "c")}
    nodes.extend(started.values())
    spare = _poll_one(started, r"round \d+ is running; waiting for the next round", 180)
    active = [n for n in started.values() if n is not spare]
    spare.wait_for(r"warm workers ready for local rank\(s\) 0", 240)  # ready while it waits
    leader, other = _rank0(*active)
    leader.wait_for(r"\]:step=3 ", 120)
    t_kill = time.monotonic()
    other.kill_node()
    spare.wait_for(r"started local rank\(s\) 0 from warm workers$", 120, after=t_kill)
    assert leader.wait_exit(300) == 0, leader.output[-3000:]
    assert spare.wait_exit(60) == 0, spare.output[-3000:]
    done = leader.matches(r"done steps=150 world_size=(\d+)") + spare.matches(r"done steps=150 world_size=(\d+)")
    assert [m.group(1) for m in done] == ["2"]  # the spare filled the place: still two workers


def _poll_one(candidates: dict[str, Node], pattern: str, timeout_s: float) -> Node:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        hits = [n for n in candidates.values() if n.matches(pattern)]
        if hits:
            return hits[0]
        time.sleep(0.2)
    raise TimeoutError("no node waited as a spare:\n" + "\n----\n".join(n.output[-1500:] for n in candidates.values()))


# The first warm worker of a node imports at once; later ones (the refills) wait while `hold` exists in its folder.
SLOTTED_IMPORT = """
import os, time
folder = os.environ["SLOTTED_IMPORT_DIR"]
try:
    os.close(os.open(os.path.join(folder, "first"), os.O_CREAT | os.O_EXCL))
except FileExistsError:
    deadline = time.monotonic() + 300
    while os.path.exists(os.path.join(folder, "hold")) and time.monotonic() < deadline:
        time.sleep(0.05)
"""
PLAIN = str(ROOT / "tests" / "chaos" / "scripts" / "plain_ddp_steps.py")


def test_a_scale_up_waits_for_both_nodes_warm_workers_while_the_group_trains(
        etcd_endpoint, run_id, tmp_path, nodes):  # noqa: F811
    """Node a trains alone; its refilled warm worker is held inside its imports. Node b starts with its own
    warm worker held: it does not ask to join yet, and a trains on. Released, b asks; a holds the scale-up
    while its own refill imports, training on. Once that is released too, the group restarts with b."""
    mods = tmp_path / "mods"
    mods.mkdir()
    (mods / "slotted_import.py").write_text(SLOTTED_IMPORT)
    folders = {name: tmp_path / f"imports-{name}" for name in "ab"}
    for folder in folders.values():
        folder.mkdir()
        (folder / "hold").touch()
    (folders["b"] / "first").touch()  # b's first warm worker is held too

    def start(name: str) -> Node:
        args = ["--nnodes", "1:2", "--nproc-per-node", "1", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", run_id,
                "--node-id", name, "--local-addr", "127.0.0.1", "--metrics-port", "0", "--tee", "3",
                "--rdzv-conf", "last_call_timeout=1", "--probe-bytes", "0", "--preflight", "off",
                "--warm-imports", "slotted_import,torch", "--warm-scale-up-wait", "240",
                PLAIN, "--steps", "100000", "--step-sleep", "0.1", "--print-every", "5"]
        n = Node(args, name=name, env={"PYTHONPATH": f"{ROOT}{os.pathsep}{mods}",
                                       "SLOTTED_IMPORT_DIR": str(folders[name])})
        nodes.append(n)
        return n

    def trains_on(n: Node, pattern: str) -> None:
        """A step of a's group after the line `pattern` of node n."""
        held = n.wait_for(pattern, 120)
        since = min(t for t, line in n.lines if held.group(0) in line)
        a.wait_for(r"\]:step=\d+ world_size=1", 120, after=since)

    a = start("a")
    a.wait_for(r"\]:step=5 world_size=1", 240)
    b = start("b")
    trains_on(b, r"\[b round -\] the job is running: this node asks to join once its warm workers have imported")
    assert not a.matches(r"a node waits to join")
    (folders["b"] / "hold").unlink()
    b.wait_for(r"\[b round -\] joining after \d+\.\d s: warm workers ready", 240)
    trains_on(a, r"\[a round 0\] a node waits to join: the scale-up waits for this node's warm workers")
    assert not a.matches(r"restarting the worker group: scale up")
    (folders["a"] / "hold").unlink()
    a.wait_for(r"\[a round 0\] scale-up after \d+\.\d s held: warm workers ready", 240)
    a.wait_for(r"\[a round 0\] restarting the worker group: scale up", 60)
    a.wait_for(r"node a round 1: rank \d of 2 nodes", 120)
    deadline = time.monotonic() + 180
    while not any(n.matches(r"\]:step=\d+ world_size=2") for n in (a, b)):
        assert time.monotonic() < deadline, a.output[-3000:] + b.output[-3000:]
        time.sleep(0.2)
