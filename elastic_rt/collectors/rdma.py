"""InfiniBand/RoCE port state and counters from sysfs, as a Prometheus collector."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Iterator, Mapping

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from elastic_rt.metric_spec import Kind, MetricSpec

log = logging.getLogger(__name__)

PREFIX = "elastic_rt_rdma_"
_LABELS = ("device", "port")


def _counter(suffix: str, help: str, doc: str) -> MetricSpec:
    return MetricSpec(name=f"{PREFIX}{suffix}_total", kind=Kind.COUNTER, labels=_LABELS, help=help, doc=doc)


# sysfs counter file -> (its metric, multiplier).
# Suffixes are node_exporter's infiniband collector names (node_infiniband_*), so a
# dashboard written for one works for the other by swapping the prefix.
# port_xmit_data/port_rcv_data count 4-byte words (per lane), hence x4 -> bytes.
COUNTERS: dict[str, tuple[MetricSpec, int]] = {
    "link_downed": (_counter(
        "link_downed",
        "Times the link failed to recover from an error state and went down.",
        "Link failed to recover from an error and went down."), 1),
    "link_error_recovery": (_counter(
        "link_error_recovery",
        "Times the link successfully recovered from an error state.",
        "Link recovered from an error state."), 1),
    "symbol_error": (_counter(
        "symbol_error",
        "Minor link errors detected on one or more physical lanes.",
        "Minor link errors on a physical lane (cable/transceiver health)."), 1),
    "port_rcv_errors": (_counter(
        "port_errors_received",
        "Packets containing an error received on this port.",
        "Packets received with an error."), 1),
    "port_xmit_discards": (_counter(
        "port_discards_transmitted",
        "Outbound packets discarded because the port is down or congested.",
        "Outbound packets discarded (port down or congested)."), 1),
    "port_rcv_discards": (_counter(
        "port_discards_received",
        "Inbound packets discarded because the port is down or congested.",
        "Inbound packets discarded."), 1),
    "port_rcv_remote_physical_errors": (_counter(
        "port_receive_remote_physical_errors",
        "Packets received marked with the EBP (End of Bad Packet) delimiter.",
        "Packets received marked bad (EBP delimiter)."), 1),
    "port_rcv_switch_relay_errors": (_counter(
        "port_receive_switch_relay_errors",
        "Packets that could not be forwarded by the switch.",
        "Packets the switch could not forward."), 1),
    "local_link_integrity_errors": (_counter(
        "local_link_integrity_errors",
        "Times local physical errors exceeded the LocalPhyErrors threshold.",
        "Local physical errors exceeded the LocalPhyErrors threshold."), 1),
    "excessive_buffer_overrun_errors": (_counter(
        "excessive_buffer_overrun_errors",
        "Times consecutive flow control update periods had buffer overruns.",
        "Flow-control periods with buffer overruns."), 1),
    "VL15_dropped": (_counter(
        "vl15_dropped",
        "Incoming VL15 (subnet management) packets dropped for lack of resources.",
        "Subnet management (VL15) packets dropped."), 1),
    "port_xmit_constraint_errors": (_counter(
        "port_constraint_errors_transmitted",
        "Packets not transmitted because of partition/constraint checks.",
        "Packets not sent because of partition/constraint checks."), 1),
    "port_rcv_constraint_errors": (_counter(
        "port_constraint_errors_received",
        "Packets received and discarded because of partition/constraint checks.",
        "Packets dropped on receive by partition/constraint checks."), 1),
    "port_xmit_data": (_counter(
        "port_data_transmitted_bytes",
        "Data octets transmitted on all lanes (sysfs counts 4-byte words).",
        "Bytes sent (sysfs counts 4-byte words)."), 4),
    "port_rcv_data": (_counter(
        "port_data_received_bytes",
        "Data octets received on all lanes (sysfs counts 4-byte words).",
        "Bytes received."), 4),
    "port_xmit_packets": (_counter(
        "port_packets_transmitted",
        "Packets transmitted on all VLs, including errors.",
        "Packets sent, all VLs."), 1),
    "port_rcv_packets": (_counter(
        "port_packets_received",
        "Packets received on all VLs, including errors.",
        "Packets received, all VLs."), 1),
    "port_xmit_wait": (_counter(
        "port_transmit_wait",
        "Ticks during which the port had data to send but sent none.",
        "Ticks with data to send but no credit to send it (congestion)."), 1),
    "unicast_xmit_packets": (_counter(
        "unicast_packets_transmitted",
        "Unicast packets transmitted, including errors.",
        "Unicast packets sent."), 1),
    "unicast_rcv_packets": (_counter(
        "unicast_packets_received",
        "Unicast packets received, including errors.",
        "Unicast packets received."), 1),
    "multicast_xmit_packets": (_counter(
        "multicast_packets_transmitted",
        "Multicast packets transmitted, including errors.",
        "Multicast packets sent."), 1),
    "multicast_rcv_packets": (_counter(
        "multicast_packets_received",
        "Multicast packets received, including errors.",
        "Multicast packets received."), 1),
}

STATE, PHYS_STATE, RATE, PORT_INFO = GAUGES = (
    MetricSpec(name=PREFIX + "state_id", kind=Kind.GAUGE, labels=_LABELS,
               help="Logical port state (0: no change, 1: down, 2: init, 3: armed, 4: active, 5: act defer).",
               doc="Logical state: 1 down, 2 init, 3 armed, 4 active, 5 active-defer."),
    MetricSpec(name=PREFIX + "physical_state_id", kind=Kind.GAUGE, labels=_LABELS,
               help="Physical port state (0: no change, 1: sleep, 2: polling, 3: disabled, 4: port configuration "
                    "training, 5: link up, 6: link error recovery, 7: phy test).",
               doc="Physical state: 1 sleep, 2 polling, 3 disabled, 4 training, 5 link up, 6 link error recovery, "
                   "7 phy test."),
    MetricSpec(name=PREFIX + "rate_bytes_per_second", kind=Kind.GAUGE, labels=_LABELS,
               help="Port signalling rate, bytes per second.",
               doc="Signalling rate (`100 Gb/sec (4X EDR)` -> 12.5e9)."),
    MetricSpec(name=PREFIX + "port_info", kind=Kind.GAUGE, labels=(*_LABELS, "link_layer", "state", "phys_state"),
               help="Always 1; labels carry the port's link layer and state names.",
               doc="Always 1; extra labels `link_layer` (`InfiniBand`/`Ethernet`), `state` (`ACTIVE`...), "
                   "`phys_state` (`LinkUp`...)."),
)
# metric name -> the sysfs files of a port it is read from (docs/metrics.md's source column)
SOURCES: dict[str, str] = {
    STATE.name: "`state`", PHYS_STATE.name: "`phys_state`", RATE.name: "`rate`",
    PORT_INFO.name: "`link_layer`, `state`, `phys_state`",
    **{spec.name: f"`counters/{name}`" + (f" x {scale}" if scale != 1 else "")
       for name, (spec, scale) in COUNTERS.items()},
}


class SysfsValueError(ValueError):
    """A sysfs file holds something this module cannot parse."""


def parse_state(text: str) -> tuple[int, str]:
    """'4: ACTIVE' -> (4, 'ACTIVE')."""
    num, sep, name = text.strip().partition(":")
    if not sep or not num.strip().isdigit():
        raise SysfsValueError(f"expected 'ID: NAME', got {text.strip()!r}")
    return int(num), name.strip()


def parse_rate(text: str) -> float:
    """'100 Gb/sec (4X EDR)' -> bytes per second (12.5e9)."""
    parts = text.strip().split()
    if len(parts) < 2:
        raise SysfsValueError(f"expected '<number> Gb/sec ...', got {text.strip()!r}")
    try:
        value = float(parts[0])
    except ValueError as exc:
        raise SysfsValueError(f"rate {text.strip()!r} does not start with a number") from exc
    unit = parts[1].lower()
    bits_per_unit = {"gb/sec": 1e9, "mb/sec": 1e6, "tb/sec": 1e12}.get(unit)
    if bits_per_unit is None:
        raise SysfsValueError(f"unknown rate unit in {text.strip()!r}")
    return value * bits_per_unit / 8


def parse_counter(text: str) -> int:
    value = text.strip()
    if not value.isdigit():
        raise SysfsValueError(f"expected a non-negative integer, got {value[:40]!r}")
    return int(value)


@dataclass(kw_only=True)
class PortReading:
    """What could be read of one port; None/absent where a file was missing or bad."""

    device: str
    port: str
    state: tuple[int, str] | None = None
    phys_state: tuple[int, str] | None = None
    rate_bytes_per_s: float | None = None
    link_layer: str | None = None
    counters: dict[str, int] = field(default_factory=dict)  # sysfs name -> scaled value


class RdmaCollector(Collector):
    """Exports every port under <sysfs_root>/class/infiniband at scrape time.

    No infiniband directory: exports nothing (logged once). A file that is missing,
    unreadable or garbage: that value is skipped (logged once per file), the rest
    of the port is still exported.
    """

    def __init__(self, *, sysfs_root: str = "/sys", const_labels: Mapping[str, str] | None = None) -> None:
        self._class_dir = os.path.join(sysfs_root, "class", "infiniband")
        self._const = dict(const_labels or {})  # e.g. run_id, node: added to every sample
        self._logged: set[str] = set()

    def _log_once(self, key: str, msg: str, *args: object) -> None:
        if key not in self._logged:
            self._logged.add(key)
            log.info(msg, *args)

    def _read(self, path: str) -> str | None:
        try:
            with open(path, encoding="ascii", errors="replace") as fh:
                return fh.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            self._log_once(path, "rdma: cannot read %s (%s); skipping this value", path, exc)
            return None

    def _parse(self, path: str, parser, text: str | None):
        if text is None:
            return None
        try:
            return parser(text)
        except SysfsValueError as exc:
            self._log_once(path, "rdma: %s: %s; skipping this value", path, exc)
            return None

    def read_ports(self) -> list[PortReading]:
        """All ports found, sorted by (device, port)."""
        try:
            devices = sorted(os.listdir(self._class_dir))
        except FileNotFoundError:
            self._log_once("<none>", "rdma: %s does not exist; no RDMA metrics on this node", self._class_dir)
            return []
        except OSError as exc:
            self._log_once("<class>", "rdma: cannot list %s (%s); no RDMA metrics", self._class_dir, exc)
            return []
        readings = []
        for device in devices:
            ports_dir = os.path.join(self._class_dir, device, "ports")
            try:
                ports = sorted(os.listdir(ports_dir), key=lambda p: (len(p), p))
            except OSError as exc:
                self._log_once(ports_dir, "rdma: cannot list %s (%s); skipping device", ports_dir, exc)
                continue
            for port in ports:
                readings.append(self._read_port(device, port, os.path.join(ports_dir, port)))
        return readings

    def _read_port(self, device: str, port: str, port_dir: str) -> PortReading:
        def value(name: str, parser):
            path = os.path.join(port_dir, name)
            return self._parse(path, parser, self._read(path))

        reading = PortReading(
            device=device,
            port=port,
            state=value("state", parse_state),
            phys_state=value("phys_state", parse_state),
            rate_bytes_per_s=value("rate", parse_rate),
            link_layer=value("link_layer", lambda t: t.strip() or None),
        )
        counters_dir = os.path.join(port_dir, "counters")
        for name, (_, scale) in COUNTERS.items():
            path = os.path.join(counters_dir, name)
            raw = self._parse(path, parse_counter, self._read(path))
            if raw is not None:
                reading.counters[name] = raw * scale
        return reading

    def _families(self) -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily, dict]:
        base = list(self._const)
        state, phys, rate, info = (spec.family(labels=base) for spec in GAUGES)
        counters = {name: spec.family(labels=base) for name, (spec, _) in COUNTERS.items()}
        return state, phys, rate, info, counters

    def collect(self) -> Iterator:
        state, phys, rate, info, counters = self._families()
        for r in self.read_ports():
            labels = list(self._const.values()) + [r.device, r.port]
            if r.state is not None:
                state.add_metric(labels, r.state[0])
            if r.phys_state is not None:
                phys.add_metric(labels, r.phys_state[0])
            if r.rate_bytes_per_s is not None:
                rate.add_metric(labels, r.rate_bytes_per_s)
            state_name = r.state[1] if r.state else ""
            phys_name = r.phys_state[1] if r.phys_state else ""
            info.add_metric(labels + [r.link_layer or "", state_name, phys_name], 1)
            for name, value in r.counters.items():
                counters[name].add_metric(labels, value)
        yield from (state, phys, rate, info)
        yield from counters.values()

    def describe(self) -> Iterator:
        # Registering must not read sysfs; the names are static (checked for clashes).
        state, phys, rate, info, counters = self._families()
        yield from (state, phys, rate, info)
        yield from counters.values()
