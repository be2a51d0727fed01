"""Find the processes of one run on this host (agents, workers, the etcd serving it) and nothing else.

Agents are recognised by their command line (`elastic-rt launch ... --rdzv-id RUN`),
workers by the environment their agent gave them (ELASTIC_RT_RUN_ID,
ELASTIC_RT_AGENT_PID, ELASTIC_RT_NODE_ID; readable for the job's own user or
root). Anything that does not match is not part of the run and is never chosen.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
from dataclasses import dataclass, field
from typing import Callable, Iterable

import psutil

from elastic_rt.errors import ConfigError, ElasticRTError
from elastic_rt.worker_env import ENV_NODE_ID, ENV_PARENT_PID, ENV_RUN_ID


class RefusedError(ElasticRTError):
    """The target is not part of the named run (or cannot be shown to be): nothing was touched."""

    exit_code = 2


@dataclass(frozen=True, kw_only=True)
class AgentInfo:
    """What an agent's command line says about it."""

    run_id: str | None  # None: generated at start (no --rdzv-id); learnt from its workers
    node_id: str | None
    endpoints: tuple[tuple[str, int], ...]


@dataclass(kw_only=True)
class Node:
    """One agent of the run on this host and the workers it started."""

    agent: psutil.Process
    node_id: str
    endpoints: tuple[tuple[str, int], ...] = ()
    workers: list[psutil.Process] = field(default_factory=list)

    def rank_of(self, worker: psutil.Process) -> int | None:
        try:
            rank = worker.environ().get("RANK", "")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            return None
        return int(rank) if rank.isdigit() else None

    def tree(self) -> list[psutil.Process]:
        """The agent, its workers and every descendant, captured now."""
        procs = {self.agent.pid: self.agent}
        for root in [self.agent, *self.workers]:
            try:
                for p in root.children(recursive=True):
                    procs[p.pid] = p
            except psutil.NoSuchProcess:
                continue
        for w in self.workers:
            procs.setdefault(w.pid, w)
        return list(procs.values())


@dataclass(kw_only=True)
class RunProcesses:
    run_id: str
    nodes: list[Node] = field(default_factory=list)

    def workers(self) -> list[tuple[Node, psutil.Process]]:
        return [(n, w) for n in self.nodes for w in n.workers]

    def endpoints(self) -> set[tuple[str, int]]:
        return {ep for n in self.nodes for ep in n.endpoints}


def _launch_parser() -> argparse.ArgumentParser:
    from elastic_rt.launch_config import add_launch_arguments

    class Quiet(argparse.ArgumentParser):
        def error(self, message: str):  # type: ignore[override]
            raise ValueError(message)

    p = Quiet(add_help=False)
    add_launch_arguments(p)
    return p


def parse_agent_cmdline(cmdline: list[str]) -> AgentInfo | None:
    """AgentInfo when `cmdline` is `elastic-rt launch ...` (console script or python -m elastic_rt.cli)."""
    if not cmdline or not os.path.basename(cmdline[0]).startswith("python"):
        return None  # agents are Python processes; a wrapper (timeout, sh -c) is not the agent
    for i, arg in enumerate(cmdline[:-1]):
        if i == 0:
            continue
        if os.path.basename(arg) == "elastic-rt" or arg == "elastic_rt.cli":
            if cmdline[i + 1] != "launch":
                return None
            try:
                args, _ = _launch_parser().parse_known_args(cmdline[i + 2:])
            except ValueError:
                return None
            run_id = args.rdzv_id if args.rdzv_id not in (None, "", "none") else None
            endpoints: tuple[tuple[str, int], ...] = ()
            if args.rdzv_endpoint and not args.standalone:
                from elastic_rt.rendezvous.registration import parse_endpoints

                try:
                    endpoints = parse_endpoints(args.rdzv_endpoint)
                except ConfigError:
                    endpoints = ()
            return AgentInfo(run_id=run_id, node_id=args.node_id, endpoints=endpoints)
    return None


ProcessSource = Callable[[], Iterable[psutil.Process]]


def find_run(run_id: str, *, processes: ProcessSource = psutil.process_iter) -> RunProcesses:
    """Every agent and worker of `run_id` visible on this host."""
    agents: dict[int, tuple[psutil.Process, AgentInfo]] = {}
    workers: list[tuple[psutil.Process, dict]] = []
    me = os.getpid()
    for p in processes():
        if p.pid == me:
            continue
        try:
            info = parse_agent_cmdline(p.cmdline())
            if info is not None:
                agents[p.pid] = (p, info)
                continue
            env = p.environ()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        if env.get(ENV_RUN_ID) == run_id:
            workers.append((p, env))
    run = RunProcesses(run_id=run_id)
    by_agent: dict[int, Node] = {}
    for pid, (proc, info) in agents.items():
        if info.run_id == run_id:
            by_agent[pid] = Node(agent=proc, node_id=info.node_id or "", endpoints=info.endpoints)
    for proc, env in workers:
        agent_pid = env.get(ENV_PARENT_PID, "")
        if not agent_pid.isdigit() or int(agent_pid) not in agents:
            continue  # not started by a live agent we can see
        try:
            if proc.ppid() != int(agent_pid):
                continue  # a descendant of a worker (DataLoader, ...): part of its worker's tree
        except psutil.NoSuchProcess:
            continue
        a_proc, a_info = agents[int(agent_pid)]
        if a_info.run_id not in (None, run_id):
            continue  # an agent of another run
        node = by_agent.get(a_proc.pid)
        if node is None:
            node = by_agent[a_proc.pid] = Node(agent=a_proc, node_id="", endpoints=a_info.endpoints)
        node.node_id = node.node_id or env.get(ENV_NODE_ID, "")
        node.workers.append(proc)
    for node in by_agent.values():
        node.workers.sort(key=lambda w: (node.rank_of(w) is None, node.rank_of(w) or 0, w.pid))
        node.node_id = node.node_id or f"pid-{node.agent.pid}"
        run.nodes.append(node)
    run.nodes.sort(key=lambda n: n.node_id)
    return run


def resolve(host: str) -> set[str]:
    try:
        return {str(ipaddress.ip_address(a[4][0].split("%")[0])) for a in socket.getaddrinfo(host, None)}
    except (OSError, ValueError):
        return set()


def etcd_serving(endpoints: set[tuple[str, int]], *, processes: ProcessSource = psutil.process_iter
                 ) -> list[psutil.Process]:
    """etcd processes on this host that listen on one of `endpoints` (a wildcard listener counts)."""
    wanted = [(port, resolve(host)) for host, port in endpoints]
    out = []
    for p in processes():
        try:
            if not is_etcd(p):
                continue
            listening = [c.laddr for c in p.net_connections(kind="inet") if c.status == psutil.CONN_LISTEN]
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        for addr in listening:
            ip = str(ipaddress.ip_address(addr.ip.split("%")[0]))
            if any(addr.port == port and (ip in ips or ipaddress.ip_address(ip).is_unspecified)
                   for port, ips in wanted):
                out.append(p)
                break
    return out


def is_etcd(p: psutil.Process) -> bool:
    try:
        names = {p.name(), os.path.basename(p.exe() or "")}
    except psutil.AccessDenied:
        names = {p.name()}
    return "etcd" in names
