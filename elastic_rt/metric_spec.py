"""What one exported metric is (MetricSpec): its name, type, labels, help and operator docs, the series it
exports at zero, and the events that feed it. The metric, its events and its docs/metrics.md row all come
from the one spec."""

from __future__ import annotations

import time
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Iterable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

BASE_LABELS = ("run_id", "node")  # on every series of every agent


class Kind(str, Enum):
    """A Prometheus metric type; the value is the word docs/metrics.md's Type column shows."""

    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


class WallClock:
    """Feed.value for "the wall clock when the event happened" (a *_timestamp_seconds gauge)."""


WALL_CLOCK = WallClock()


@dataclass(frozen=True, kw_only=True)
class Feed:
    """How one event sets a metric: a gauge is set to the value, a histogram observes it, a counter is
    increased by it. `value` names the event's keyword argument that holds it, or is a number, or
    WALL_CLOCK; None increases a counter by 1. A value that is None at the event leaves the metric as it is.
    The metric's own labels (beyond run_id and node) are read from the event's keyword arguments."""

    event: str
    value: str | float | WallClock | None = None


@dataclass(frozen=True, kw_only=True)
class MetricSpec:
    """One metric. `name` is the exported name (a counter's with `_total`); `help` is its HELP text;
    `doc` the meaning in docs/metrics.md (help when empty); `labels` those beyond run_id and node;
    `zeros` the label values (beyond run_id and node) of the series exported from the start, so that
    rate(), increase() and alerts count the first event too."""

    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...] = ()
    doc: str = ""
    buckets: tuple[float, ...] = ()
    zeros: tuple[tuple[str, ...], ...] = ()
    fed_by: tuple[Feed, ...] = ()

    def build(self, registry: CollectorRegistry, *, run_id: str, node: str) -> Counter | Gauge | Histogram:
        """The prometheus_client metric in `registry`, with the `zeros` series of this agent."""
        labels = [*BASE_LABELS, *self.labels]
        if self.kind is Kind.COUNTER:
            metric = Counter(self.name, self.help, labels, registry=registry)
        elif self.kind is Kind.GAUGE:
            metric = Gauge(self.name, self.help, labels, registry=registry)
        else:
            metric = Histogram(self.name, self.help, labels, buckets=self.buckets, registry=registry)
        for values in self.zeros:
            metric.labels(run_id, node, *values)
        return metric

    def family(self, labels: Iterable[str] = BASE_LABELS) -> CounterMetricFamily | GaugeMetricFamily:
        """An empty family for a collector that reads its values at scrape time."""
        cls = CounterMetricFamily if self.kind is Kind.COUNTER else GaugeMetricFamily
        name = self.name[: -len("_total")] if self.kind is Kind.COUNTER else self.name
        return cls(name, self.help, labels=[*labels, *self.labels])

    def row(self) -> str:
        """This metric's row of a docs/metrics.md table (Metric | Type | Labels | Meaning)."""
        meaning = self.doc or self.help
        if self.buckets:
            meaning += " Buckets: " + ", ".join(f"{b:g}" for b in self.buckets) + "."
        labels = ", ".join((*BASE_LABELS, *self.labels))
        return f"| `{self.name}` | {self.kind.value} | {labels} | {meaning} |"


def table(specs: Iterable[MetricSpec]) -> str:
    """A docs/metrics.md table of these metrics."""
    return "\n".join(["| Metric | Type | Labels | Meaning |", "|---|---|---|---|", *(s.row() for s in specs)])


class SpecMetrics:
    """The metrics of `specs` in a registry the caller owns, set by events: `emit(event, **values)` applies
    every Feed of that event name. A metric fed by an event that already exists needs only its spec."""

    def __init__(self, specs: Iterable[MetricSpec], *, registry: CollectorRegistry, run_id: str, node: str,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._base = (run_id, node)
        self._wall_clock = wall_clock
        self.metric: dict[str, Counter | Gauge | Histogram] = {}
        self._feeds: dict[str, list[tuple[MetricSpec, Feed]]] = {}
        for spec in specs:
            self.metric[spec.name] = spec.build(registry, run_id=run_id, node=node)
            for feed in spec.fed_by:
                self._feeds.setdefault(feed.event, []).append((spec, feed))

    def events(self) -> frozenset[str]:
        """The event names some spec is fed by."""
        return frozenset(self._feeds)

    def emit(self, event: str, **values: object) -> None:
        """Apply `event` (its keyword arguments in `values`) to every metric it feeds."""
        for spec, feed in self._feeds.get(event, ()):
            value = self._value(feed, values)
            if value is None:
                continue
            series = self.metric[spec.name].labels(*self._base, *(str(values[label]) for label in spec.labels))
            if spec.kind is Kind.COUNTER:
                series.inc(value)
            elif spec.kind is Kind.GAUGE:
                series.set(value)
            else:
                series.observe(value)

    def _value(self, feed: Feed, values: Mapping[str, object]) -> float | None:
        if feed.value is None:
            return 1.0
        if isinstance(feed.value, WallClock):
            return self._wall_clock()
        if isinstance(feed.value, str):
            value = values[feed.value]
            return None if value is None else float(value)
        return float(feed.value)
