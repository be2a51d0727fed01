"""Fault injectors for drills against a live run: kill or pause a worker or a node, pause etcd.

Each takes a snapshot of the run's processes (found by `processes.find_run`, or
given by a test), chooses only among them, and reports every injected fault as
one JSON line through `emit`.
"""

from __future__ import annotations

import random
import signal
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, TextIO

import psutil

from elastic_rt.chaos.processes import Node, RefusedError, RunProcesses, etcd_serving, is_etcd
from elastic_rt.chaos.resumer import arm, fault_line, start_resumer, stop_resumer


def printer(out: TextIO | None = None) -> Callable[[str], None]:
    def emit(line: str) -> None:
        stream = sys.stdout if out is None else out
        print(line, file=stream, flush=True)
    return emit


@dataclass
class Drill:
    """Inject faults into one run. `stop` ends a pause early (SIGINT/SIGTERM of the drill)."""

    run: RunProcesses
    emit: Callable[[str], None] = field(default_factory=printer)
    rng: random.Random = field(default_factory=random.Random)
    stop: threading.Event = field(default_factory=threading.Event)

    # ---- selection (only ever among the run's processes) -------------------
    def _require_processes(self) -> None:
        if not self.run.nodes:
            raise RefusedError(
                f"no process of run {self.run.run_id!r} on this host (agents are found by `--rdzv-id "
                f"{self.run.run_id}` on their command line, workers by ELASTIC_RT_RUN_ID; run as the "
                "job's user or root); nothing touched"
            )

    def select_node(self, *, node_id: str | None = None, pid: int | None = None) -> Node:
        if pid is not None and pid not in {n.agent.pid for n in self.run.nodes}:
            raise RefusedError(f"pid {pid} is not an agent of run {self.run.run_id!r}; refusing to touch it")
        self._require_processes()
        nodes = self.run.nodes
        if node_id is not None:
            nodes = [n for n in nodes if n.node_id == node_id]
            if not nodes:
                known = ", ".join(n.node_id for n in self.run.nodes)
                raise RefusedError(f"node {node_id!r} is not a node of run {self.run.run_id!r} on this host "
                                   f"(its nodes here: {known}); nothing touched")
        if pid is not None:
            nodes = [n for n in nodes if n.agent.pid == pid]
            if not nodes:
                raise RefusedError(f"pid {pid} is not the agent of node {node_id!r}; nothing touched")
        return self.rng.choice(nodes)

    def select_worker(self, *, pid: int | None = None, rank: int | None = None,
                      node_id: str | None = None) -> tuple[Node, psutil.Process]:
        if pid is not None and pid not in {w.pid for _, w in self.run.workers()}:
            raise RefusedError(f"pid {pid} is not a worker of run {self.run.run_id!r}; refusing to touch it")
        self._require_processes()
        pairs = self.run.workers()
        if node_id is not None:
            self.select_node(node_id=node_id)  # refuses an unknown node with its own message
            pairs = [(n, w) for n, w in pairs if n.node_id == node_id]
        if pid is not None:
            pairs = [(n, w) for n, w in pairs if w.pid == pid]
            if not pairs:
                raise RefusedError(f"pid {pid} is not a worker of node {node_id!r}; nothing touched")
        if rank is not None:
            pairs = [(n, w) for n, w in pairs if n.rank_of(w) == rank]
            if not pairs:
                raise RefusedError(f"no worker of rank {rank} in run {self.run.run_id!r} on this host; "
                                   "nothing touched")
        if not pairs:
            raise RefusedError(f"run {self.run.run_id!r} has no running worker on this host right now "
                               "(restarting?); nothing touched")
        return self.rng.choice(pairs)

    # ---- faults ---------------------------------------------------------------
    def kill_worker(self, *, sig: int = signal.SIGKILL, **select) -> list[int]:
        node, worker = self.select_worker(**select)
        rank = node.rank_of(worker)
        _signal([worker], sig)
        self.emit(fault_line("kill-worker", run_id=self.run.run_id, node=node.node_id, pids=[worker.pid],
                             rank=rank, signal=signal.Signals(sig).name))
        return [worker.pid]

    def kill_node(self, *, sig: int = signal.SIGKILL, **select) -> list[int]:
        node = self.select_node(**select)
        procs = node.tree()  # captured before the first signal: orphans are still found
        _signal(procs, sig)
        pids = sorted(p.pid for p in procs)
        self.emit(fault_line("kill-node", run_id=self.run.run_id, node=node.node_id, pids=pids,
                             agent_pid=node.agent.pid, signal=signal.Signals(sig).name))
        return pids

    def pause_worker(self, *, duration_s: float, **select) -> list[int]:
        node, worker = self.select_worker(**select)
        return self._pause("pause-worker", node.node_id, [worker], duration_s, rank=node.rank_of(worker))

    def pause_node(self, *, duration_s: float, **select) -> list[int]:
        node = self.select_node(**select)
        return self._pause("pause-node", node.node_id, node.tree(), duration_s, agent_pid=node.agent.pid)

    def pause_etcd(self, *, duration_s: float, pids: list[int] | None = None,
                   serving: Callable[[set], list[psutil.Process]] = etcd_serving) -> list[int]:
        """SIGSTOP the etcd member(s) that serve this run's agents (all found, or the pids given)."""
        self._require_processes()
        endpoints = self.run.endpoints()
        if not endpoints:
            raise RefusedError(f"run {self.run.run_id!r} does not use etcd (no --rdzv-endpoint on its agents' "
                               "command lines); nothing touched")
        members = serving(endpoints)
        described = ",".join(f"{h}:{p}" for h, p in sorted(endpoints))
        if pids:
            by_pid = {p.pid: p for p in members}
            for pid in pids:
                if pid not in by_pid:
                    why = ("is an etcd process but does not serve" if _is_etcd_pid(pid)
                           else "is not an etcd process serving")
                    raise RefusedError(f"pid {pid} {why} run {self.run.run_id!r}'s endpoints ({described}) "
                                       "on this host; refusing to touch it")
            members = [by_pid[pid] for pid in pids]
        if not members:
            raise RefusedError(f"no etcd process on this host listens on run {self.run.run_id!r}'s endpoints "
                               f"({described}); pause-etcd runs where an agent of the run and its etcd member(s) both "
                               "run; nothing touched")
        return self._pause("pause-etcd", None, members, duration_s, endpoints=described)

    def _pause(self, action: str, node_id: str | None, procs: list[psutil.Process], duration_s: float,
               **extra) -> list[int]:
        """SIGSTOP, wait, SIGCONT. A detached resumer (resumer.py) started first sends SIGCONT at the deadline
        even if this process is killed meanwhile; `stop` (SIGINT, SIGTERM, SIGHUP) resumes at once."""
        pids = sorted(p.pid for p in procs)
        resumer = start_resumer(procs, run_id=self.run.run_id, node=node_id, action=action)
        try:
            _signal(procs, signal.SIGSTOP)
            deadline = time.monotonic() + duration_s
            arm(resumer, deadline)
            try:
                self.emit(fault_line(action, run_id=self.run.run_id, node=node_id, pids=pids,
                                     duration_s=duration_s, resumer_pid=resumer.pid, **extra))
                self.stop.wait(max(0.0, deadline - time.monotonic()))
            finally:
                _signal(procs, signal.SIGCONT)
                self.emit(fault_line("resume", run_id=self.run.run_id, node=node_id, pids=pids,
                                     after=action, early=self.stop.is_set()))
        finally:
            stop_resumer(resumer)
        return pids


def _signal(procs: list[psutil.Process], sig: int) -> None:
    """Signal each process that is still the one we found (psutil checks its start time)."""
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            continue


def _is_etcd_pid(pid: int) -> bool:
    try:
        return is_etcd(psutil.Process(pid))
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return False
