"""Per-worker resource and step-heartbeat metrics (WORKERS), read at scrape time (psutil, heartbeat files)."""

from __future__ import annotations

import logging
import os
from typing import Callable, Iterator, Mapping

import psutil
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from elastic_rt.metric_spec import Kind, MetricSpec
from elastic_rt.worker_reports.heartbeat import Heartbeat

log = logging.getLogger(__name__)

WORKERS = (
    MetricSpec(name="elastic_rt_worker_resident_memory_bytes", kind=Kind.GAUGE, labels=("local_rank",),
               help="Resident set size of the worker process (and its live descendants).",
               doc="Resident set size of the worker process plus its live descendants (DataLoader workers); pages "
                   "shared between them are counted once per process."),
    MetricSpec(name="elastic_rt_worker_cpu_seconds_total", kind=Kind.COUNTER, labels=("local_rank",),
               help="User+system CPU time of the worker process (and its descendants); resets when the worker "
                    "restarts.",
               doc="User + system CPU time of the worker, its reaped children and its live descendants. Resets "
                   "when the worker restarts (`rate()` handles resets)."),
    MetricSpec(name="elastic_rt_worker_last_step", kind=Kind.GAUGE, labels=("local_rank",),
               help="Last training step the worker reported with elastic_rt.report_step(), else its optimizer "
                    "steps.",
               doc="Last step the worker reported with `report_step()`, else the number of its optimizer steps "
                   "(every `optimizer.step()` is progress, see [failures.md](failures.md)). Absent for a worker "
                   "that never stepped."),
    MetricSpec(name="elastic_rt_worker_last_step_age_seconds", kind=Kind.GAUGE, labels=("local_rank",),
               help="Seconds since the worker's last step (optimizer step or report_step).",
               doc="Seconds since that step."),
)

_GONE = (psutil.NoSuchProcess, psutil.ZombieProcess, psutil.AccessDenied)


def _own_usage(proc: psutil.Process) -> tuple[int, float]:
    """(rss bytes, cpu seconds incl. reaped children) of one process."""
    with proc.oneshot():
        rss = proc.memory_info().rss
        t = proc.cpu_times()
    return rss, t.user + t.system + t.children_user + t.children_system


class WorkerCollector(Collector):
    """RSS, CPU seconds, last step and its age for each local worker.

    pids() returns {local_rank: pid} of the running workers (the agent's view at
    scrape time); heartbeats() returns {local_rank: Heartbeat | None}. With
    include_descendants, a worker's live descendants (DataLoader workers, compile
    workers) are added to its RSS and CPU; shared pages are then counted more than
    once, which over- rather than under-states memory pressure.
    """

    def __init__(
        self,
        *,
        run_id: str,
        node: str,
        pids: Callable[[], Mapping[int, int]] | None = None,
        heartbeats: Callable[[], Mapping[int, Heartbeat | None]] | None = None,
        include_descendants: bool = True,
        proc_root: str = "/proc",
    ) -> None:
        self._base = [run_id, node]
        self._pids = pids
        self._heartbeats = heartbeats
        self._descendants = include_descendants
        self._proc = proc_root
        # /proc/<pid>/task/<tid>/children (CONFIG_PROC_CHILDREN) lists a thread's
        # children without scanning every process on the host.
        me = os.getpid()
        self._children_files = os.path.exists(os.path.join(proc_root, str(me), "task", str(me), "children"))

    @staticmethod
    def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return tuple(spec.family() for spec in WORKERS)

    def _children_from_proc(self, pid: int) -> list[int]:
        task_dir = os.path.join(self._proc, str(pid), "task")
        try:
            tids = os.listdir(task_dir)
        except OSError:
            return []
        kids: list[int] = []
        for tid in tids:
            try:
                with open(os.path.join(task_dir, tid, "children"), "rb") as fh:
                    kids.extend(int(x) for x in fh.read().split())
            except (OSError, ValueError):
                continue
        return kids

    def _children_getter(self) -> Callable[[int], list[int]]:
        if self._children_files:
            return self._children_from_proc
        by_parent: dict[int, list[int]] = {}  # fallback: one scan of all processes
        for proc in psutil.process_iter(["ppid"]):
            ppid = proc.info.get("ppid")
            if ppid:
                by_parent.setdefault(ppid, []).append(proc.pid)
        return lambda pid: by_parent.get(pid, [])

    def _usage(self, pid: int, children: Callable[[int], list[int]] | None) -> tuple[int, float] | None:
        try:
            rss, cpu = _own_usage(psutil.Process(pid))
        except _GONE:
            return None
        if children is not None:
            seen = {pid}
            stack = list(children(pid))
            while stack:
                child = stack.pop()
                if child in seen:
                    continue
                seen.add(child)
                stack.extend(children(child))
                try:
                    c_rss, c_cpu = _own_usage(psutil.Process(child))
                except _GONE:
                    continue
                rss += c_rss
                cpu += c_cpu
        return rss, cpu

    def collect(self) -> Iterator:
        rss, cpu, step, age = self._families()
        if self._pids is not None:
            try:
                pids = dict(self._pids())
            except Exception as exc:  # a scrape must not fail because the agent is mid-restart
                log.debug("worker pids unavailable at scrape: %s", exc)
                pids = {}
            children = self._children_getter() if (pids and self._descendants) else None
            for rank, pid in sorted(pids.items()):
                usage = self._usage(pid, children)
                if usage is None:
                    continue
                labels = self._base + [str(rank)]
                rss.add_metric(labels, usage[0])
                cpu.add_metric(labels, usage[1])
        if self._heartbeats is not None:
            try:
                beats = dict(self._heartbeats())
            except Exception as exc:
                log.debug("heartbeats unavailable at scrape: %s", exc)
                beats = {}
            for rank, beat in sorted(beats.items()):
                if beat is None:
                    continue
                labels = self._base + [str(rank)]
                step.add_metric(labels, beat.step)
                age.add_metric(labels, beat.age_s)
        yield from (rss, cpu, step, age)

    def describe(self) -> Iterator:
        yield from self._families()
