"""The goodput feature's Prometheus metrics (GOODPUT: time by category, lost steps, step and compute time per
rank, straggler flags) as MetricSpecs, and the step-time histogram whose observations may stand for many steps."""

from __future__ import annotations

import bisect
import threading
from typing import Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

from elastic_rt.metric_spec import Kind, MetricSpec

GOODPUT_CATEGORIES = ("productive", "startup", "restart", "checkpoint", "restore", "lost", "other")
STEP_TIME_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)

SECONDS, UNCOMMITTED, RATIO, LOST_STEPS, STEP_DURATION, STEP_TIME, STEP_TIME_RATIO, COMPUTE_TIME, \
    COMPUTE_TIME_RATIO, STRAGGLER = GOODPUT = (
        MetricSpec(name="elastic_rt_goodput_seconds_total", kind=Kind.COUNTER, labels=("category",),
                   help="Wall time of this agent since the job started, by category (settled time).",
                   doc="This agent's wall time since its process started, by `category`: "
                       + ", ".join(f"`{c}`" for c in GOODPUT_CATEGORIES) + ". Training time joins `productive` "
                       "when a commit (or the successful end) settles it, `lost` when a failure throws it away; "
                       "until then it is in the gauge below. Exported at 0 for every category from the start.",
                   zeros=tuple((c,) for c in GOODPUT_CATEGORIES)),
        MetricSpec(name="elastic_rt_goodput_uncommitted_seconds", kind=Kind.GAUGE,
                   help="Training time since the last commit: productive if kept, lost on a failure.",
                   doc="Training time since the last commit, not yet settled. The categories plus this sum to "
                       "the agent's wall time."),
        MetricSpec(name="elastic_rt_goodput_ratio", kind=Kind.GAUGE,
                   help="(productive + uncommitted) / wall time since the job started.",
                   doc="(productive + uncommitted) / wall time since the agent started: the share whose progress "
                       "is still held."),
        MetricSpec(name="elastic_rt_goodput_lost_steps_total", kind=Kind.COUNTER,
                   help="Steps re-done after failures.",
                   doc="Steps re-done after failures (reported step at the failure minus the last committed "
                       "step).", zeros=((),)),
        MetricSpec(name="elastic_rt_step_duration_seconds", kind=Kind.HISTOGRAM, labels=("local_rank",),
                   help="Time per training step of each local worker, from its step heartbeats.",
                   doc="Time per step of each worker, from its step heartbeats; one observation may stand for "
                       "many short steps, so `_count` counts steps and `_sum` their time.",
                   buckets=STEP_TIME_BUCKETS_S),
        MetricSpec(name="elastic_rt_step_time_seconds", kind=Kind.GAUGE, labels=("local_rank",),
                   help="Median step time of the worker in the last window.",
                   doc="The worker's median step time in the last window (`--straggler-window`)."),
        MetricSpec(name="elastic_rt_step_time_ratio", kind=Kind.GAUGE, labels=("local_rank",),
                   help="The worker's median step time / the job's median (all nodes).",
                   doc="That median over the job's median (all nodes' workers), from the last verdict of group "
                       "rank 0's agent."),
        MetricSpec(name="elastic_rt_compute_time_seconds", kind=Kind.GAUGE, labels=("local_rank",),
                   help="Median compute time per step of the worker in the last window: the time between "
                        "optimizer steps outside backward() (where lock-step ranks wait for each other).",
                   doc="The worker's compute time per step in the last window: between optimizer steps, outside "
                       "`backward()` and torch.distributed's collectives (the mean without the slowest tenth); "
                       "names the slow rank of a lock-step job."),
        MetricSpec(name="elastic_rt_compute_time_ratio", kind=Kind.GAUGE, labels=("local_rank",),
                   help="The worker's median compute time per step / the job's median (all nodes).",
                   doc="That figure over the job's median compute time, from the last verdict."),
        MetricSpec(name="elastic_rt_straggler", kind=Kind.GAUGE, labels=("local_rank",),
                   help="1 while the worker is flagged as a straggler, else 0.",
                   doc="1 while the worker is flagged as a straggler (by step or compute time), else 0."),
    )


class StepTimeHistogram(Collector):
    """elastic_rt_step_duration_seconds per local rank, where one observation may stand for many steps
    (a tick that saw 100 steps of 1 ms adds 100 to the count): _count is steps, _sum their time."""

    def __init__(self, *, run_id: str, node: str, buckets: tuple = STEP_TIME_BUCKETS_S) -> None:
        self._base = [run_id, node]
        self._bounds = tuple(float(b) for b in buckets) + (float("inf"),)
        self._ranks: dict[int, tuple[list[int], list[float]]] = {}  # rank -> (bucket counts, [sum])
        self._lock = threading.Lock()

    def observe(self, local_rank: int, duration_s: float, steps: int = 1) -> None:
        with self._lock:
            counts, total = self._ranks.setdefault(local_rank, ([0] * len(self._bounds), [0.0]))
            counts[bisect.bisect_left(self._bounds, duration_s)] += steps
            total[0] += duration_s * steps

    def _family(self) -> HistogramMetricFamily:
        return HistogramMetricFamily(STEP_DURATION.name, STEP_DURATION.help,
                                     labels=["run_id", "node", *STEP_DURATION.labels])

    def collect(self):
        fam = self._family()
        with self._lock:
            snapshot = {r: (list(c), t[0]) for r, (c, t) in self._ranks.items()}
        for rank, (counts, total) in sorted(snapshot.items()):
            cumulative, acc = [], 0
            for bound, n in zip(self._bounds, counts):
                acc += n
                cumulative.append(("+Inf" if bound == float("inf") else repr(bound), acc))
            fam.add_metric(self._base + [str(rank)], cumulative, total)
        yield fam

    def describe(self):
        yield self._family()


class GoodputMetrics:
    """Goodput by category, step time per rank and straggler flags of one agent."""

    def __init__(self, *, registry: CollectorRegistry, run_id: str, node: str) -> None:
        self._base = (run_id, node)
        self.seconds, self.uncommitted, self.ratio, self.lost_steps, self.step_time, self.step_time_ratio, \
            self.compute_time, self.compute_time_ratio, self.straggler = (
                spec.build(registry, run_id=run_id, node=node) for spec in GOODPUT if spec is not STEP_DURATION)
        self.step_histogram = StepTimeHistogram(run_id=run_id, node=node)
        registry.register(self.step_histogram)
        self._exported = dict.fromkeys(GOODPUT_CATEGORIES, 0.0)
        self._ranks: set[int] = set()

    def on_totals(self, totals: Mapping[str, float], *, uncommitted_s: float, ratio: float) -> None:
        """The ledger's totals (they only grow): counters advance by the difference."""
        for category in GOODPUT_CATEGORIES:
            delta = totals.get(category, 0.0) - self._exported[category]
            if delta > 0:
                self.seconds.labels(*self._base, category).inc(delta)
                self._exported[category] += delta
        self.uncommitted.labels(*self._base).set(uncommitted_s)
        self.ratio.labels(*self._base).set(ratio)

    def on_lost_steps(self, steps: int) -> None:
        self.lost_steps.labels(*self._base).inc(max(0, steps))

    def on_step_times(self, medians: Mapping[int, float], *, job_median_s: float | None = None) -> None:
        self._per_rank(self.step_time, self.step_time_ratio, medians, job_median_s)
        self._ranks.update(medians)

    def on_compute_times(self, medians: Mapping[int, float], *, job_median_s: float | None = None) -> None:
        self._per_rank(self.compute_time, self.compute_time_ratio, medians, job_median_s)

    def _per_rank(self, gauge, ratio, medians: Mapping[int, float], job_median_s: float | None) -> None:
        """Each rank's median, and its ratio to the job's median when there is one."""
        for rank, value in medians.items():
            gauge.labels(*self._base, str(rank)).set(value)
            if job_median_s:
                ratio.labels(*self._base, str(rank)).set(value / job_median_s)

    def on_stragglers(self, flagged: set[int], local_ranks: set[int]) -> None:
        """Set the flag of every local rank (1: flagged)."""
        for rank in local_ranks | self._ranks:
            self.straggler.labels(*self._base, str(rank)).set(1.0 if rank in flagged else 0.0)
