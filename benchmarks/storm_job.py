"""One storm configuration's job: K launcher processes (elastic-rt on one etcd, or torchrun over c10d), its kills,
and what their output says: steps kept, lost steps per failure, restores by tier, time without training."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import statistics
import sys
import time
import uuid

from checkpoint_restart import SCRIPT, Launcher
from elastic_rt.agent.host_memory import HOST_CACHE_OWNER
from elastic_rt.agent.replica_server import tree_bytes

STEP_RE = re.compile(r"\]:step=(\d+) loss=\S+ world_size=(\d+)")
STARTED_RE = re.compile(r"\] started local rank\(s\)")  # an elastic-rt agent (re)started its workers
SAVED_RE = re.compile(r"\]:checkpoint saved step=(\d+) ")
START_RE = re.compile(r"\]:start step=(\d+) world_size=(\d+)(?:.* restored_from=(\w+))?")
NPROC = 2
SHM = "/dev/shm"


def free_port() -> int:
    from etcd_testbed.server import free_port as _free_port  # the repository's testbed (checkpoint_restart's path)

    return _free_port()


def learning_rate(hidden: int) -> float:
    """The example's SGD learning rate scaled to its width: its output sums `hidden` units, so the default 0.05
    makes a wide model's loss NaN within steps (the same arithmetic, but not a model a user would train)."""
    return min(0.05, 0.32 / hidden)


class StormJob:
    """The K nodes of one configuration (`n0`..`n{K-1}`, 2 workers each). A replaced node's lines stay counted.

    torchrun: `--rdzv-backend c10d`, n0 hosts the store (`is_host=1`), so a node storm never kills n0 (losing the
    store ends a torchrun job); elastic-rt's runs are killed on the same schedule. With `--nodes 1` every
    launcher runs `--standalone`, as storm.py did before it had nodes."""

    def __init__(self, name: str, args: argparse.Namespace, scratch: str, *, etcd_endpoint: str | None,
                 secret_file: str) -> None:
        self.name, self.args = name, args
        self.slug = name.replace(" ", "-")
        self.torchrun = name == "torchrun"
        self.memory = name.endswith("memory")
        self.scratch = scratch
        self.run_id = f"storm-{self.slug}-{uuid.uuid4().hex[:6]}"
        self.etcd_endpoint, self.secret_file = etcd_endpoint, secret_file
        self.store_port = free_port() if self.torchrun and args.nodes > 1 else None
        self.launched: list[Launcher] = []  # every incarnation of every node, in start order
        self.nodes: list[Launcher] = []
        for i in range(args.nodes):
            self.nodes.append(self._start(i))
        self.tier_max = {"own": 0, "replicas": 0}  # the most bytes one node's memory tier held at a sample

    def _command(self, i: int) -> tuple[list[str], tuple[str, ...]]:
        a = self.args
        job = [SCRIPT, "--steps", "100000000", "--save-every", str(a.persist_every), "--step-sleep",
               str(a.step_sleep), "--hidden", str(a.hidden), "--lr", str(learning_rate(a.hidden)),
               "--ckpt-url", f"file://{self.scratch}/{self.slug}",
               *(["--memory-every", str(a.memory_every), "--async-save"] if self.memory else [])]
        common = ["--nproc-per-node", str(NPROC), "--max-restarts", "1000", "--tee", "3"]
        nnodes = f"{a.nodes - 1}:{a.nodes}"
        if self.torchrun:
            rdzv = (["--standalone"] if a.nodes == 1 else
                    ["--nnodes", nnodes, "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.store_port}",
                     "--rdzv-id", self.run_id, "--rdzv-conf", f"is_host={int(i == 0)}", "--local-addr", "127.0.0.1"])
            return [*rdzv, *common, *job], (sys.executable, "-m", "torch.distributed.run")
        rdzv = (["--standalone"] if a.nodes == 1 else
                ["--nnodes", nnodes, "--rdzv-endpoint", str(self.etcd_endpoint), "--rdzv-id", self.run_id,
                 "--node-id", f"n{i}", "--local-addr", "127.0.0.1", "--rdzv-conf", f"secret_file={self.secret_file}"])
        # The storm's kills come from outside: the crash-loop judge (docs/failures.md) would end the persisting
        # run, whose kills repeat with no commit in between, and the job would stop being measured.
        return [*rdzv, "--metrics-port", "0", "--crash-loop-repeats", "0", "--crash-loop-no-step", "0",
                *common, *job], ()

    def _start(self, i: int) -> Launcher:
        args, launcher = self._command(i)
        log = os.path.join(self.scratch, f"{self.slug}-n{i}-{len(self.launched)}.log")
        node = Launcher(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), args, log, launcher=launcher)
        self.launched.append(node)
        return node

    # ---- what the job prints --------------------------------------------------------------------------
    def lines(self) -> list[tuple[float, str]]:
        out = [x for n in self.launched for x in list(n.lines)]
        out.sort(key=lambda x: x[0])
        return out

    def wait_trained_together(self, timeout_s: float) -> float:
        """The time of the first step all K nodes trained (world size 2K): the storm's clock starts there."""
        rx = re.compile(rf"\]:step=\d+ loss=\S+ world_size={NPROC * self.args.nodes}\b")
        deadline = time.monotonic() + timeout_s
        seen = 0
        while True:
            lines = self.lines()
            for t, line in lines[seen:]:
                if rx.search(line):
                    return t
            seen = len(lines)
            exited = [n.log_path for n in self.nodes if n.proc.poll() is not None]
            if time.monotonic() > deadline or exited:
                tail = "\n".join(line for _, line in lines[-20:])
                raise TimeoutError(f"{self.name}: no step at world size {NPROC * self.args.nodes} within "
                                   f"{timeout_s:g} s (exited: {exited}):\n{tail}")
            time.sleep(0.2)

    # ---- kills -------------------------------------------------------------------------------------------
    def kill_worker(self, i: int) -> None:
        """SIGKILL local rank 1 of node i (raises between restarts, when it has no such worker yet)."""
        self.nodes[i].worker(1).send_signal(signal.SIGKILL)

    def replace_node(self, i: int) -> float:
        """SIGKILL node i (its launcher and every process under it) and start it again at once, as a
        Kubernetes or Slurm replacement would (an elastic-rt agent clears the node's old memory tier at
        start: the replacement brings no snapshot). Returns the time of the kill."""
        self.sample_tiers()
        t = self.nodes[i].kill()
        self.nodes[i] = self._start(i)
        return t

    def sample_tiers(self) -> None:
        """The bytes each live elastic-rt node's memory tier holds (own snapshots, replicas): the largest kept."""
        if self.torchrun:
            return
        agents = {n.proc.pid for n in self.nodes if n.proc.poll() is None}
        for name in os.listdir(SHM):
            path = os.path.join(SHM, name)
            try:
                with open(os.path.join(path, HOST_CACHE_OWNER)) as f:
                    if int(f.read().split()[0]) not in agents:
                        continue
            except (OSError, ValueError, IndexError):
                continue
            for kind in ("own", "replicas"):
                self.tier_max[kind] = max(self.tier_max[kind], tree_bytes(os.path.join(path, "tier", kind)))

    def close(self) -> None:
        """Kill every node and remove the memory tiers their SIGKILLed agents left in shared memory."""
        for n in self.nodes:
            n.kill()
        for name in os.listdir(SHM):
            if self.run_id in name:
                shutil.rmtree(os.path.join(SHM, name), ignore_errors=True)


def account(lines: list[tuple[float, str]], kills: list[tuple[float, str]], t0: float, end: float) -> dict:
    """What the lines say about a storm from t0 to end. Progress at a time is the value of the last step
    line or restart line (`start step=K`: the step it restored) before it, so a rollback counts; a job
    killed after its last such line and not restarted by `end` counts its newest commit (`checkpoint saved
    step=K`, storage or memory tier, since its last restart) or the step it last resumed from.

    Per restart after t0: `lost` (progress before it minus the step it resumed from), the tier it restored
    from (`memory`, `storage`, `none`: nothing to restore), `gap_s` (from the last step line before it to
    the first after it, or to `end`: the job did not train; overlapping gaps count once in `no_training_s`).
    A restart belongs to the last kill before it; the
    first restart after a node kill that restored from memory read the lost node's shards from a replica.
    Per kill: the sum of its restarts' lost steps."""
    events: list[tuple[float, str, int, re.Match]] = []
    saved: list[tuple[float, int]] = []
    restarts: list[dict] = []
    idle: list[tuple[float, float]] = []
    started: list[float] = []
    for t, line in lines:
        if STARTED_RE.search(line):
            started.append(t)
        elif m := STEP_RE.search(line):
            events.append((t, "step", int(m.group(1)), m))
        elif m := START_RE.search(line):
            events.append((t, "start", int(m.group(1)), m))
        elif m := SAVED_RE.search(line):
            saved.append((t, int(m.group(1))))
    so_far = [e for e in events if e[0] <= end]
    kept, t_last = (so_far[-1][2], so_far[-1][0]) if so_far else (0, t0)
    if any(t_last < k <= end for k, _ in kills):  # down at the end: it resumes from its newest commit
        t_run = max((e[0] for e in so_far if e[1] == "start"), default=float("-inf"))
        run_start = next((e[2] for e in reversed(so_far) if e[1] == "start"), 0)
        kept = max([run_start, *(s for t, s in saved if t_run <= t <= end and s <= kept)])
        idle.append((max((e[0] for e in so_far if e[1] == "step"), default=t0), end))
    for i, (t, kind, value, m) in enumerate(events):
        if kind != "start" or t < t0 or t > end:
            continue
        before = events[i - 1][2]
        last_step = next((e[0] for e in reversed(events[:i]) if e[1] == "step"), t)
        next_step = next((e[0] for e in events[i + 1:] if e[1] == "step"), None)
        owner = max((j for j, (k, _) in enumerate(kills) if k <= t), default=None)
        tier = m.group(3) or ("none" if value == 0 else "unknown")
        gap_end = end if next_step is None else min(next_step, end)
        idle.append((last_step, gap_end))
        agent = max((x for x in started if x <= t), default=None)
        restarts.append({"t_s": round(t - t0, 2), "resumed": value, "lost": before - value, "tier": tier,
                         "world_size": int(m.group(2)), "kill": owner, "gap_s": round(gap_end - last_step, 2),
                         # elastic-rt: from its agents' last start of the workers to rank 0's start line (the
                         # process group, the model, the checkpoint manager and the restore)
                         "worker_init_s": None if agent is None else round(t - agent, 2)})
    for j, (_k, kind) in enumerate(kills):
        mine = [r for r in restarts if r["kill"] == j]
        if mine and mine[0]["tier"] == "memory" and kind == "node":
            mine[0]["tier"] = "replica"
    per_kill = [sum(r["lost"] for r in restarts if r["kill"] == j) for j in range(len(kills))
                if any(r["kill"] == j for r in restarts)]
    by_tier: dict[str, int] = {}
    for r in restarts:
        by_tier[r["tier"]] = by_tier.get(r["tier"], 0) + 1
    return {"steps_reached": kept, "kills": len(kills), "lost_per_failure": per_kill, "restarts": restarts,
            "kills_without_restart": sum(1 for j in range(len(kills)) if not any(r["kill"] == j for r in restarts)),
            "restores_by_tier": by_tier, "no_training_s": round(_union_s(idle), 1),
            "median_worker_init_s": (round(statistics.median(inits), 2) if (inits := [
                r["worker_init_s"] for r in restarts if r["worker_init_s"] is not None]) else None)}


def _union_s(intervals: list[tuple[float, float]]) -> float:
    """Seconds covered by the intervals (a failure's restarts overlap)."""
    total, reach = 0.0, float("-inf")
    for a, b in sorted(intervals):
        a = max(a, reach)
        if b > a:
            total += b - a
            reach = b
    return total
