"""The cut-etcd drill: a TCP proxy between one agent and etcd that is cut (or slowed) for a while, then healed.

The agent must have been started with `--rdzv-endpoint` naming the proxy's listen
address. The proxy forwards until an agent of the run uses it, cuts after
`cut_after_s` for `duration_s`, heals, and keeps forwarding until no agent of
the run uses it any more (or the drill is stopped).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Callable

from elastic_rt.chaos.resumer import fault_line
from elastic_rt.chaos.processes import Node, RefusedError, RunProcesses, find_run, resolve
from elastic_rt.chaos.proxy import TcpProxy, format_hostport
from elastic_rt.errors import ConfigError

MODES = ("reset", "blackhole", "delay")


@dataclass(frozen=True, kw_only=True)
class CutPlan:
    """Where the proxy listens, the etcd it forwards to, and the fault."""

    listen: tuple[str, int]
    target: tuple[str, int]
    mode: str = "blackhole"
    delay_s: float = 0.0
    cut_after_s: float = 0.0
    duration_s: float = 10.0
    wait_agent_s: float = 120.0
    poll_s: float = 0.5

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ConfigError(f"--mode {self.mode!r}: choose one of {', '.join(MODES)}")
        if self.mode == "delay" and self.delay_s <= 0:
            raise ConfigError("--mode delay needs --delay SECONDS > 0")
        for name in ("delay_s", "cut_after_s", "duration_s", "wait_agent_s"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name[:-2].replace('_', '-')} must be >= 0")


def nodes_using(run: RunProcesses, listen: tuple[str, int]) -> list[Node]:
    """The run's nodes whose --rdzv-endpoint names the proxy's address."""
    host, port = listen
    ips = resolve(host)
    return [n for n in run.nodes
            if any(p == port and (h == host or resolve(h) & ips) for h, p in n.endpoints)]


def run_cut_etcd(plan: CutPlan, run_id: str, *, emit: Callable[[str], None], stop: threading.Event,
                 find: Callable[[str], RunProcesses] = find_run) -> int:
    """Run the drill to its end; 0 when the fault was injected and lifted."""
    listen = format_hostport(*plan.listen)
    target = format_hostport(*plan.target)
    with TcpProxy(plan.target[0], plan.target[1], listen_host=plan.listen[0], listen_port=plan.listen[1]) as proxy:
        emit(fault_line("proxy-ready", run_id=run_id, node=None, pids=[], listen=proxy.endpoint, target=target))
        nodes: list[Node] = []
        waited = 0.0
        while not nodes:
            nodes = nodes_using(find(run_id), plan.listen)
            if nodes:
                break
            if waited >= plan.wait_agent_s:
                raise RefusedError(
                    f"no agent of run {run_id!r} on this host uses the proxy at {listen} within "
                    f"{plan.wait_agent_s:g} s (start it with --rdzv-endpoint {listen}); nothing cut"
                )
            if stop.wait(plan.poll_s):
                return 130
            waited += plan.poll_s
        if stop.wait(plan.cut_after_s):
            return 130
        nodes = nodes_using(find(run_id), plan.listen) or nodes
        names = ",".join(n.node_id for n in nodes)
        pids = sorted(n.agent.pid for n in nodes)
        if plan.mode == "delay":
            proxy.delay(plan.delay_s)
        else:
            proxy.cut(plan.mode)
        emit(fault_line("cut-etcd", run_id=run_id, node=names, pids=pids, mode=plan.mode,
                        delay_s=plan.delay_s, duration_s=plan.duration_s, listen=proxy.endpoint, target=target))
        early = stop.wait(plan.duration_s)
        proxy.delay(0.0)
        proxy.heal()
        emit(fault_line("heal-etcd", run_id=run_id, node=names, pids=pids, early=early))
        if early:
            return 130
        while nodes_using(find(run_id), plan.listen):  # keep the agents' etcd path open while they run
            if stop.wait(max(plan.poll_s, 1.0)):
                break
        emit(fault_line("proxy-closed", run_id=run_id, node=names, pids=pids))
    return 0
