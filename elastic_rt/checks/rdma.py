"""The one RDMA-port rule (which ports NCCL uses, which of them are down) and NCCL's interface/HCA list
syntax; doctor's rdma row and /readyz's rdma check both render this rule's verdict."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from elastic_rt.checks.model import Status

# sysfs logical port state ids: 1 down, 2 init, 3 armed, 4 active, 5 active-defer. A port is up from
# ACTIVE on: the same rule as the ElasticRTRDMAPortDown alert (elastic_rt_rdma_state_id < 4).
RDMA_ACTIVE = 4


@dataclass(frozen=True, kw_only=True)
class NcclList:
    """An NCCL interface/HCA list: '^' excludes, '=' matches names exactly, else names are prefixes."""

    exclude: bool
    exact: bool
    items: tuple[tuple[str, str | None], ...]  # (name, port or None)

    @classmethod
    def parse(cls, text: str) -> "NcclList":
        text = text.strip()
        exclude = text.startswith("^")
        text = text[1:] if exclude else text
        exact = text.startswith("=")
        text = text[1:] if exact else text
        items = []
        for raw in text.split(","):
            name, _, port = raw.strip().partition(":")
            if name:
                items.append((name, port or None))
        return cls(exclude=exclude, exact=exact, items=tuple(items))

    def _matches(self, name: str, port: str | None) -> bool:
        for item, item_port in self.items:
            if (name == item if self.exact else name.startswith(item)) and (item_port is None or item_port == port):
                return True
        return False

    def selects(self, name: str, port: str | None = None) -> bool:
        return self._matches(name, port) != self.exclude


def nccl_ports(ports: Sequence[Any], env: Mapping[str, str]) -> list[Any]:
    """The ports NCCL would use: all of them, or those NCCL_IB_HCA selects."""
    hca = env.get("NCCL_IB_HCA", "").strip()
    if not hca:
        return list(ports)
    chosen = NcclList.parse(hca)
    return [p for p in ports if chosen.selects(p.device, p.port)]


def port_active(port: Any) -> bool:
    return port.state is not None and port.state[0] >= RDMA_ACTIVE


@dataclass(frozen=True, kw_only=True)
class RdmaVerdict:
    """The rule applied to one node's ports under one environment."""

    status: Status
    ports: tuple[Any, ...]  # every port found
    used: tuple[Any, ...]  # those NCCL would use (NCCL_IB_HCA)
    down: tuple[Any, ...]  # used, state readable and below ACTIVE
    unreadable: tuple[Any, ...]  # used, state unreadable
    ib_disabled: bool  # NCCL_IB_DISABLE=1: NCCL uses none of them

    @property
    def not_selected(self) -> int:
        return len(self.ports) - len(self.used)

    @property
    def active(self) -> tuple[Any, ...]:
        return tuple(p for p in self.used if port_active(p))


def rdma_verdict(ports: Sequence[Any], env: Mapping[str, str]) -> RdmaVerdict:
    """skip: no ports; warn: NCCL_IB_HCA selects none, a used port's state is unreadable, or ports are down
    while NCCL_IB_DISABLE=1; fail: a port NCCL would use is below ACTIVE; else ok."""
    used = tuple(nccl_ports(ports, env))
    down = tuple(p for p in used if p.state is not None and not port_active(p))
    unreadable = tuple(p for p in used if p.state is None)
    ib_disabled = env.get("NCCL_IB_DISABLE", "").strip() == "1"
    if not ports:
        status = Status.SKIP
    elif not used:
        status = Status.WARN
    elif down:
        status = Status.WARN if ib_disabled else Status.FAIL
    else:
        status = Status.WARN if unreadable else Status.OK
    return RdmaVerdict(status=status, ports=tuple(ports), used=used, down=down, unreadable=unreadable,
                       ib_disabled=ib_disabled)
