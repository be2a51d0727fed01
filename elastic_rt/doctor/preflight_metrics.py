"""The pre-flight node test's Prometheus metrics (PREFLIGHT: this node's matmul times, its ring link, whether
it was named) as MetricSpecs, recorded by doctor/preflight.py."""

from __future__ import annotations

from typing import Mapping

from prometheus_client import CollectorRegistry

from elastic_rt.metric_spec import Kind, MetricSpec

PREFLIGHT = (
    MetricSpec(name="elastic_rt_preflight_compute_seconds", kind=Kind.GAUGE, labels=("local_rank",),
               help="Median seconds per matmul of each local device in the pre-flight test.",
               doc="Median seconds per matmul of each local device in the compute test."),
    MetricSpec(name="elastic_rt_preflight_compute_ratio", kind=Kind.GAUGE, labels=("local_rank",),
               help="A local device's pre-flight matmul time / the job's median.",
               doc="That over the job's median, from the verdict."),
    MetricSpec(name="elastic_rt_preflight_link_seconds", kind=Kind.GAUGE,
               help="Seconds the pre-flight ring test took to receive from the previous node.",
               doc="Seconds the ring test took to receive from the previous node."),
    MetricSpec(name="elastic_rt_preflight_slow", kind=Kind.GAUGE,
               help="1 when the pre-flight test named this node, else 0.",
               doc="1 when the verdict named this node, else 0."),
    MetricSpec(name="elastic_rt_preflight_duration_seconds", kind=Kind.GAUGE, labels=("phase",),
               help="Seconds the last pre-flight phase took (compute test, or ring test and verdict).",
               doc="Seconds the last `compute` test, or the `round`'s ring test and verdict, took."),
)


class PreflightMetrics:
    """The launch's pre-flight test: this node's matmul times, its ring link, and whether it was named."""

    def __init__(self, *, registry: CollectorRegistry, run_id: str, node: str) -> None:
        self._base = (run_id, node)
        self.compute, self.compute_ratio, self.link, self.slow, self.duration = (
            spec.build(registry, run_id=run_id, node=node) for spec in PREFLIGHT)
        self._compute: dict[int, float] = {}

    def on_compute(self, seconds: Mapping[int, float], *, duration_s: float) -> None:
        self._compute = dict(seconds)
        for rank, value in seconds.items():
            self.compute.labels(*self._base, str(rank)).set(value)
        self.duration.labels(*self._base, "compute").set(duration_s)

    def on_verdict(self, *, compute_median_s: float, link_s: float | None, slow: bool, duration_s: float) -> None:
        if compute_median_s > 0:
            for rank, value in self._compute.items():
                self.compute_ratio.labels(*self._base, str(rank)).set(value / compute_median_s)
        if link_s is not None:
            self.link.labels(*self._base).set(link_s)
        self.slow.labels(*self._base).set(1.0 if slow else 0.0)
        self.duration.labels(*self._base, "round").set(duration_s)
