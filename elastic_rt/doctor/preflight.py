"""The pre-flight node test of `launch --preflight`: before the first round each node times a matmul
on every local device (doctor/bench.py); when the round forms, before any worker starts, the nodes
run a ring link test (collectors/probe.py) and publish both to the round's store; the agent of group
rank 0 judges every node against the job median and publishes the verdict. Named nodes are logged and
exported; with `exclude` they leave (NodeExcludedError) and the others meet again without them
(RoundRejectedError). Time-boxed: a test or a verdict that does not come in time is skipped with a
warning, never a reason to stop. Skipped on re-formations unless --preflight-rounds all.
"""

from __future__ import annotations

import json
import logging
import statistics
import time
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from enum import Enum
from typing import Any, Callable

from elastic_rt.doctor.bench import ComputeResult, local_devices, run_local
from elastic_rt.doctor.preflight_metrics import PreflightMetrics
from elastic_rt.errors import ConfigError, HealthCheckError, NodeExcludedError, RoundRejectedError
from elastic_rt.sections import option, positive

log = logging.getLogger(__name__)

_NODE_KEY = "elastic-rt/preflight/node/{}"
_PORT_KEY = "elastic-rt/preflight/port"
_VERDICT_KEY = "elastic-rt/preflight/verdict"
RING_BYTES = {"nccl": 64 << 20, "gloo": 8 << 20}


class PreflightMode(str, Enum):
    OFF = "off"
    REPORT = "report"  # name slow nodes (log, metrics)
    EXCLUDE = "exclude"  # and make them leave before training
    AUTO = "auto"  # report where CUDA is available, else off


def _times_median(value: float) -> float:
    if not value > 1:
        raise ConfigError(f"--preflight-threshold {value:g}: must be > 1 (times the median)")
    return value


class Finding(str, Enum):
    COMPUTE = "compute"  # a local device's matmul is slow
    LINK = "link"  # both ring links through the node are slow
    FAILED = "failed"  # its compute or link test failed
    MISSING = "missing"  # it published nothing in time


@dataclass(frozen=True, kw_only=True)
class PreflightSettings:
    """The node test's config section: --preflight, --preflight-threshold, --preflight-timeout,
    --preflight-rounds; and the job's MIN (set by `resolved`)."""

    mode: PreflightMode = option(
        "--preflight", default="auto", choices=("auto", "off", "report", "exclude"), parse=PreflightMode,
        help="before the first round: a matmul per local device, then a ring link test across the round; report: "
             "name nodes beyond --preflight-threshold x the job median; exclude: they also leave before training "
             "(exit 4); auto (default): report with CUDA, else off (docs/goodput.md)")
    threshold: float = option(
        "--preflight-threshold", type=float, default=1.5, parse=_times_median,
        help="times the job median matmul or link time that names a node (default 1.5)")
    timeout_s: float = option(
        "--preflight-timeout", type=float, default=60.0, parse=positive("--preflight-timeout"),
        help="seconds the pre-flight test may take in all; past them the job trains without it (default 60)")
    every_round: bool = option(
        "--preflight-rounds", default="first", choices=("first", "all"), parse=lambda v: v == "all",
        help="test at the first round only (default), or at every re-formation too")
    compute_s: float = 2.0  # seconds of matmuls per device
    min_nodes: int = 1

    def resolved(self, *, cuda: bool, min_nodes: int) -> PreflightSettings:
        """auto made concrete (report with CUDA, else off), with the job's MIN."""
        mode = self.mode
        if mode is PreflightMode.AUTO:
            mode = PreflightMode.REPORT if cuda else PreflightMode.OFF
        return replace(self, mode=mode, min_nodes=min_nodes)


@dataclass(frozen=True, kw_only=True)
class NodeReport:
    """What one node publishes: seconds per matmul by local rank, its incoming ring link, errors."""

    node: str
    compute_s: dict[int, float] = field(default_factory=dict)
    link_s: float | None = None
    error: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "NodeReport":
        d = json.loads(text)
        return cls(node=str(d["node"]), compute_s={int(k): float(v) for k, v in d["compute_s"].items()},
                   link_s=None if d["link_s"] is None else float(d["link_s"]), error=str(d["error"]))


@dataclass(frozen=True, kw_only=True)
class Named:
    node: str
    finding: Finding
    detail: str


@dataclass(frozen=True, kw_only=True)
class PreflightVerdict:
    compute_median_s: float
    link_median_s: float
    named: tuple[Named, ...] = ()
    excluded: tuple[str, ...] = ()
    kept: str = ""  # why named nodes were not excluded, if so

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str | bytes) -> "PreflightVerdict":
        d = json.loads(text)
        return cls(compute_median_s=float(d["compute_median_s"]), link_median_s=float(d["link_median_s"]),
                   named=tuple(Named(node=n["node"], finding=Finding(n["finding"]), detail=n["detail"])
                               for n in d["named"]),
                   excluded=tuple(d["excluded"]), kept=str(d["kept"]))


def _median(values: list[float]) -> float:
    return statistics.median_low(values) if values else 0.0


def judge(reports: list[NodeReport | None], order: list[str], *, threshold: float, min_nodes: int,
          exclude: bool) -> PreflightVerdict:
    """reports[i]: the report of order[i] (the round's ranks; None: it published nothing). A node is named
    when a device's matmul takes >= threshold x the job median, when the links into and out of it both
    take >= threshold x the median link (3+ nodes: with 2 there is one pair and no telling which end is
    slow), or when its test failed or did not report. Exclusion keeps at least min_nodes, worst first."""
    n = len(order)
    compute = [v for r in reports if r for v in r.compute_s.values() if v > 0]
    links = [r.link_s for r in reports if r and r.link_s]
    cm, lm = _median(compute), _median(links)
    named: list[tuple[float, Named]] = []
    for i, (node, r) in enumerate(zip(order, reports)):
        if r is None:
            named.append((float("inf"), Named(node=node, finding=Finding.MISSING, detail="no pre-flight result in time")))
            continue
        if r.error:
            named.append((float("inf"), Named(node=node, finding=Finding.FAILED, detail=r.error)))
            continue
        slow = {lr: s / cm for lr, s in sorted(r.compute_s.items()) if cm and len(compute) > 1 and s >= threshold * cm}
        if slow:
            worst = max(slow.values())
            named.append((worst, Named(node=node, finding=Finding.COMPUTE, detail=", ".join(
                f"local rank {lr} matmul {r.compute_s[lr] * 1e3:.3g} ms, {ratio:.2f}x the job median "
                f"{cm * 1e3:.3g} ms" for lr, ratio in slow.items()))))
            continue
        nxt = reports[(i + 1) % n] if n >= 3 else None
        if lm and r.link_s and nxt is not None and nxt.link_s:
            link_in, link_out = r.link_s / lm, nxt.link_s / lm
            if min(link_in, link_out) >= threshold:
                named.append((min(link_in, link_out), Named(node=node, finding=Finding.LINK, detail=(
                    f"ring links in {r.link_s * 1e3:.3g} ms and out {nxt.link_s * 1e3:.3g} ms, "
                    f"{link_in:.2f}x and {link_out:.2f}x the job median {lm * 1e3:.3g} ms"))))
    excluded: list[str] = []
    kept = ""
    if exclude and named:
        room = max(0, n - min_nodes)
        worst_first = [x.node for _, x in sorted(named, key=lambda p: -p[0])]
        excluded = worst_first[:room]
        if len(excluded) < len(worst_first):
            kept = (f"{', '.join(worst_first[room:])} kept: excluding them would leave fewer than "
                    f"--nnodes MIN ({min_nodes}) nodes")
    return PreflightVerdict(compute_median_s=cm, link_median_s=lm, named=tuple(x for _, x in named),
                            excluded=tuple(excluded), kept=kept)


class Preflight:
    """The launch's pre-flight: run_compute() before the first rendezvous, on_round() as the first round
    listener (it blocks the round until the verdict, at most timeout_s)."""

    def __init__(self, *, node: str, settings: PreflightSettings, nproc: int, metrics: Any = None,
                 backend: str = "auto", clock: Callable[[], float] = time.monotonic,
                 compute_runner: Callable[..., dict[int, ComputeResult]] = run_local,
                 link_runner: Callable[..., float] | None = None) -> None:
        self._node = node
        self.settings = settings
        self._nproc = nproc
        self._metrics = metrics
        self._backend = backend
        self._clock = clock
        self._compute_runner = compute_runner
        self._link_runner = link_runner
        self._compute: dict[int, ComputeResult] = {}
        self._compute_error = ""
        self._rounds = 0
        self.verdict: PreflightVerdict | None = None

    @property
    def enabled(self) -> bool:
        return self.settings.mode in (PreflightMode.REPORT, PreflightMode.EXCLUDE)

    def run_compute(self, devices: list[str] | None = None) -> None:
        """The local compute test (time-boxed); its failure is this node's finding, not an exception."""
        if not self.enabled:
            return
        devices = devices or local_devices(self._nproc)
        t0 = self._clock()
        try:
            self._compute = self._compute_runner(devices, seconds=self.settings.compute_s,
                                                 timeout_s=self.settings.timeout_s)
            self._compute_error = ""
        except HealthCheckError as exc:
            self._compute, self._compute_error = {}, str(exc)
        took = self._clock() - t0
        if self._metrics is not None:
            self._metrics.on_compute({r: c.seconds for r, c in self._compute.items()}, duration_s=took)
        shown = "; ".join(f"local rank {r} {c.device}: {c.describe()}" for r, c in sorted(self._compute.items()))
        log.info("[%s] pre-flight compute test (%.1f s): %s", self._node, took, shown or self._compute_error)

    def on_round(self, *, round: int, store, group_rank: int, group_world_size: int,
                 master_addr: str | None = None) -> None:
        if not self.enabled or (self._rounds and not self.settings.every_round):
            return
        if self._rounds:
            self.run_compute()
        self._rounds += 1
        if group_world_size < 2:
            return
        t0 = self._clock()
        deadline = t0 + self.settings.timeout_s
        report = NodeReport(node=self._node, compute_s={r: c.seconds for r, c in self._compute.items()},
                            error=self._compute_error)
        try:
            report = self._link(report, store, group_rank, group_world_size, master_addr, deadline)
            store.set(_NODE_KEY.format(group_rank), report.to_json())
            if group_rank == 0:
                store.set(_VERDICT_KEY, self._judge(store, group_world_size, deadline).to_json())
            store.wait([_VERDICT_KEY], timedelta(seconds=max(0.1, deadline - self._clock())))
            verdict = PreflightVerdict.from_json(store.get(_VERDICT_KEY))
        except Exception as exc:  # noqa: BLE001 - a store timeout, etcd away: train without the test
            log.warning("[%s round %d] pre-flight: no verdict within %g s (%s); training without it",
                        self._node, round, self.settings.timeout_s, str(exc).splitlines()[0] if str(exc) else
                        type(exc).__name__)
            return
        self._apply(round, verdict, report, self._clock() - t0)

    def _link(self, report: NodeReport, store, rank: int, world: int, master_addr: str | None,
              deadline: float) -> NodeReport:
        from elastic_rt.collectors.probe import pick_backend, spawn_probe
        from torch.distributed.elastic.utils.distributed import get_free_port

        if rank == 0:
            store.set(_PORT_KEY, str(get_free_port()))
        store.wait([_PORT_KEY], timedelta(seconds=max(0.1, deadline - self._clock())))
        port = int(store.get(_PORT_KEY).decode())
        backend = pick_backend(self._backend)
        runner = self._link_runner or spawn_probe
        try:
            link_s = runner(master_addr=master_addr or "127.0.0.1", master_port=port, rank=rank, world_size=world,
                            nbytes=RING_BYTES[backend], timeout_s=max(1.0, deadline - self._clock()),
                            backend=backend, ring=True, nice=0)
        except HealthCheckError as exc:
            return NodeReport(node=report.node, compute_s=report.compute_s, error=report.error or str(exc))
        return NodeReport(node=report.node, compute_s=report.compute_s, link_s=link_s, error=report.error)

    def _judge(self, store, world: int, deadline: float) -> PreflightVerdict:
        keys = [_NODE_KEY.format(r) for r in range(world)]
        try:
            store.wait(keys, timedelta(seconds=max(0.1, deadline - self._clock())))
        except Exception:  # noqa: BLE001 - judge whoever reported; the others are named as missing
            pass
        reports = [NodeReport.from_json(store.get(k)) if store.check([k]) else None for k in keys]
        order = [r.node if r else f"group rank {i}" for i, r in enumerate(reports)]
        return judge(reports, order, threshold=self.settings.threshold, min_nodes=self.settings.min_nodes,
                     exclude=self.settings.mode is PreflightMode.EXCLUDE)

    def _apply(self, rnd: int, verdict: PreflightVerdict, mine: NodeReport, took_s: float) -> None:
        self.verdict = verdict
        prefix = f"[{self._node} round {rnd}]"
        me = [x for x in verdict.named if x.node == self._node]
        if self._metrics is not None:
            self._metrics.on_verdict(compute_median_s=verdict.compute_median_s, link_s=mine.link_s,
                                     slow=bool(me), duration_s=took_s)
        log.info("%s pre-flight: %d node(s) named in %.1f s (job median matmul %.3g ms, ring link %.3g ms)%s",
                 prefix, len(verdict.named), took_s, verdict.compute_median_s * 1e3, verdict.link_median_s * 1e3,
                 "".join(f"; {x.node}: {x.finding.value}: {x.detail}" for x in verdict.named))
        if verdict.kept:
            log.warning("%s pre-flight: %s", prefix, verdict.kept)
        if self._node in verdict.excluded:
            finding = me[0]
            raise NodeExcludedError(f"pre-flight: this node is excluded ({finding.finding.value}: {finding.detail}; "
                                    f"threshold {self.settings.threshold:g}x, --preflight exclude)")
        if verdict.excluded:
            raise RoundRejectedError(f"pre-flight excluded {', '.join(verdict.excluded)}", verdict.excluded)
        for x in me:
            log.warning("%s pre-flight: this node is slow (%s: %s)", prefix, x.finding.value, x.detail)


def build_node_test(settings: PreflightSettings, *, node: str, nproc: int, min_nodes: int, backend: str | None,
                    registry: Any, run_id: str) -> Preflight:
    """This node's pre-flight test (--preflight; auto: report where CUDA is available, else off), recording
    PreflightMetrics in `registry`."""
    import torch

    return Preflight(node=node, settings=settings.resolved(cuda=torch.cuda.is_available(), min_nodes=min_nodes),
                     nproc=nproc, metrics=PreflightMetrics(registry=registry, run_id=run_id, node=node),
                     backend=backend)
