"""`elastic-rt doctor`: pre-flight checks as a table or JSON, and the hard checks the agent runs before joining."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import shutil
import sys
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, TextIO

from elastic_rt.errors import ConfigError, ElasticRTError, HealthCheckError
from elastic_rt.checks.model import CheckResult, Status, one_line, run_check
from elastic_rt.doctor.checks import (
    GIB,
    GpuInfo,
    check_etcd,
    check_free_space,
    check_gpus,
    check_kernel_clock,
    check_ntp,
    failures,
    probe_gpus,
)
from elastic_rt.doctor.net import check_nccl_env, check_rdma, list_dir

__all__ = [
    "CheckResult",
    "DoctorOptions",
    "DoctorSources",
    "Status",
    "add_subparser",
    "etcd_config",
    "first_failure",
    "hard_checks",
    "options_from_args",
    "render_json",
    "render_table",
    "run",
    "run_doctor",
]

DEFAULT_CHECKPOINT_URL = "file://checkpoints"


@dataclass(frozen=True, kw_only=True)
class DoctorOptions:
    """What to check and the thresholds; built from the command line by options_from_args."""

    etcd: Any = None  # EtcdConfig, or None: the etcd row is skipped
    ntp_servers: tuple[str, ...] = ()
    max_clock_offset_s: float = 0.5
    checkpoint_url: str = DEFAULT_CHECKPOINT_URL
    min_free_gb: float = 10.0
    sysfs_root: str = "/sys"
    timeout_s: float = 3.0  # per etcd request and per NTP query
    etcd_warn_latency_s: float = 0.1
    bench_s: float = 0.0  # --bench: seconds of matmuls per local device (0: no compute test)
    bench_threshold: float = 1.5


@dataclass(frozen=True, kw_only=True)
class DoctorSources:
    """Where the checks read from; tests replace any of them. None: the real one, imported when needed."""

    env: Mapping[str, str]
    read_timex: Callable[[], Any] | None = None
    ntp_query: Callable[..., Any] | None = None
    gpu_probe: Callable[[], GpuInfo] = probe_gpus
    etcd_client_factory: Callable[[Any], Any] | None = None  # EtcdConfig -> client
    disk_usage: Callable[[str], Any] = shutil.disk_usage
    compute_bench: Callable[..., Mapping[int, Any]] | None = None  # (devices, seconds=, timeout_s=) -> results
    devices: Callable[[], list[str]] | None = None  # the local devices to test


def etcd_config(endpoint: str, conf: Mapping[str, str], *, timeout_s: float):
    """EtcdConfig from --rdzv-endpoint and --rdzv-conf (TLS and credentials keys as `launch` reads them)."""
    from elastic_rt.rendezvous.registration import etcd_config_from_conf

    return etcd_config_from_conf(endpoint, conf, timeout_s=timeout_s)


def _seconds(flag: str, value: float) -> float:
    if not math.isfinite(value) or value <= 0:
        raise ConfigError(f"{flag} {value:g}: must be a positive number of seconds")
    return value


def options_from_args(args: argparse.Namespace) -> DoctorOptions:
    """Validate parsed `doctor` flags (raises ConfigError, exit 2)."""
    from elastic_rt.rendezvous.conf import parse_rdzv_conf
    from elastic_rt.collectors.sntp import parse_server

    timeout_s = _seconds("--timeout", args.timeout)
    etcd = None
    if args.rdzv_endpoint:
        etcd = etcd_config(args.rdzv_endpoint, parse_rdzv_conf(args.rdzv_conf), timeout_s=timeout_s)
    for server in args.ntp_server:
        parse_server(server)
    if not math.isfinite(args.min_free_gb) or args.min_free_gb < 0:
        raise ConfigError(f"--min-free-gb {args.min_free_gb:g}: must be >= 0")
    if not args.checkpoint_url.strip():
        raise ConfigError("--checkpoint-url is empty; give a path or fsspec URL")
    return DoctorOptions(
        etcd=etcd,
        ntp_servers=tuple(args.ntp_server),
        max_clock_offset_s=_seconds("--max-clock-offset", args.max_clock_offset),
        checkpoint_url=args.checkpoint_url,
        min_free_gb=args.min_free_gb,
        sysfs_root=args.sysfs_root,
        timeout_s=timeout_s,
        bench_s=_seconds("--bench-seconds", args.bench_seconds) if args.bench else 0.0,
    )


def _ib_dir(sysfs_root: str) -> str:
    return os.path.join(sysfs_root, "class", "infiniband")


def _read_ports(sysfs_root: str) -> list[Any]:
    if not os.path.isdir(_ib_dir(sysfs_root)):
        return []  # most nodes without RDMA; not worth the collector's log line
    from elastic_rt.collectors.rdma import RdmaCollector

    return RdmaCollector(sysfs_root=sysfs_root).read_ports()


def _endpoint_label(client: Any) -> str:
    config = getattr(client, "config", None)
    return config.describe() if config is not None and hasattr(config, "describe") else "etcd"


def _etcd_row(options: DoctorOptions, factory: Callable[[Any], Any] | None) -> CheckResult:
    if options.etcd is None:
        return check_etcd(None)
    if factory is None:
        from elastic_rt.rendezvous.etcd_client import EtcdClient

        factory = EtcdClient
    # One client per endpoint, so that a cluster with one member down shows it.
    clients: dict[str, Any] = {}
    try:
        for host, port in options.etcd.endpoints:
            clients[f"{host}:{port}"] = factory(dataclasses.replace(options.etcd, endpoints=((host, port),)))
        return check_etcd(clients, warn_latency_s=options.etcd_warn_latency_s)
    finally:
        for client in clients.values():
            client.close()


def run_doctor(options: DoctorOptions, sources: DoctorSources) -> list[CheckResult]:
    """Every check, in table order; a check that raises becomes a failed row."""
    from elastic_rt.collectors import sntp, timex

    read_timex = sources.read_timex or timex.read_timex
    ntp_query = sources.ntp_query or sntp.query
    ports: list[Any] = []

    def rdma() -> CheckResult:
        ports.extend(_read_ports(options.sysfs_root))
        return check_rdma(ports, sources.env, where=_ib_dir(options.sysfs_root))

    results = [
        run_check("etcd", lambda: _etcd_row(options, sources.etcd_client_factory)),
        run_check("clock", lambda: check_kernel_clock(
            read_timex, max_offset_s=options.max_clock_offset_s, ntp_given=bool(options.ntp_servers)
        )),  # fmt: skip
    ]
    for server in options.ntp_servers:
        results.append(run_check(f"ntp {server}", lambda s=server: check_ntp(
            s, ntp_query, max_offset_s=options.max_clock_offset_s, timeout_s=options.timeout_s
        )))  # fmt: skip
    interfaces = list_dir(os.path.join(options.sysfs_root, "class", "net"))
    results += [
        run_check("rdma", rdma),
        run_check("nccl env", lambda: check_nccl_env(sources.env, interfaces=interfaces, ports=ports)),
        run_check("gpus", lambda: check_gpus(sources.gpu_probe, sources.env)),
        run_check("checkpoint space", lambda: check_free_space(
            options.checkpoint_url, min_free_bytes=int(options.min_free_gb * GIB), disk_usage=sources.disk_usage
        )),  # fmt: skip
    ]
    if options.bench_s > 0:
        results += bench_rows(options, sources)
    return results


def bench_rows(options: DoctorOptions, sources: DoctorSources) -> list[CheckResult]:
    """--bench: one row per local device with its matmul rate; a device at least bench_threshold x the
    node's median time fails (a node's lemon GPU); a test that fails or hangs fails its row."""
    from elastic_rt.doctor import bench

    devices = (sources.devices or (lambda: sorted(set(bench.local_devices(_visible_devices())))))()
    runner = sources.compute_bench or bench.run_local
    try:
        results = runner(devices, seconds=options.bench_s, timeout_s=options.bench_s * 10 + 60)
    except ElasticRTError as exc:
        return [CheckResult(name="compute", status=Status.FAIL, detail=str(exc))]
    slow = bench.slow_devices({r.device: r.seconds for r in results.values()}, options.bench_threshold)
    rows = []
    for _, r in sorted(results.items()):
        detail = r.describe()
        if r.device in slow:
            detail += f"; {slow[r.device]:.2f}x the node's median: a slow device"
        rows.append(CheckResult(name=f"compute {r.device}", status=Status.FAIL if r.device in slow else Status.OK,
                                detail=detail, data={"seconds": r.seconds, "tflops": r.tflops, "size": r.size}))
    return rows


def _visible_devices() -> int:
    import torch

    return max(1, torch.cuda.device_count()) if torch.cuda.is_available() else 1


def hard_checks(
    *, etcd_client: Any = None, sysfs_root: str = "/sys", env: Mapping[str, str] | None = None
) -> list[CheckResult]:
    """The checks that stop the agent from joining: etcd answers (through etcd_client, which the
    caller owns and closes) and no RDMA port that NCCL would use is down. `env` selects ports via
    NCCL_IB_HCA / NCCL_IB_DISABLE; None means this process's environment."""
    env = os.environ if env is None else env
    clients = None if etcd_client is None else {_endpoint_label(etcd_client): etcd_client}
    return [
        run_check("etcd", lambda: check_etcd(clients, samples=1)),
        run_check("rdma", lambda: check_rdma(_read_ports(sysfs_root), env, where=_ib_dir(sysfs_root))),
    ]


def first_failure(results: Iterable[CheckResult]) -> str | None:
    """One line naming the first failed check (and how many more failed), or None when none failed."""
    failed = failures(results)
    if not failed:
        return None
    first = failed[0]
    more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
    return (
        f"pre-flight check {first.name!r} failed: {one_line(first.detail)}{more}; "
        "run `elastic-rt doctor` for all checks"
    )


def refuse_an_unfit_node(*, sysfs_root: str = "/sys") -> None:
    """The launch's hard pre-flight checks (`elastic-rt doctor` runs them all): HealthCheckError, one line, when
    one fails. etcd reachability is left to the rendezvous, which retries until the join timeout."""
    failure = first_failure(hard_checks(etcd_client=None, sysfs_root=sysfs_root))
    if failure:
        raise HealthCheckError(f"{failure}; not joining the rendezvous")


def render_table(results: Iterable[CheckResult]) -> str:
    results = list(results)
    width = max([len("check")] + [len(r.name) for r in results])
    lines = [f"{'check':<{width}}  status  detail", f"{'-' * width}  ------  {'-' * 6}"]
    lines += [f"{r.name:<{width}}  {r.status.value:<6}  {one_line(r.detail)}" for r in results]
    counts = {s: sum(r.status is s for r in results) for s in Status}
    lines.append("")
    lines.append(", ".join(f"{n} {s.value}" for s, n in counts.items()))
    return "\n".join(lines)


def render_json(results: Iterable[CheckResult]) -> str:
    results = list(results)
    doc = {
        "ok": not failures(results),
        "checks": [
            {"name": r.name, "status": r.status.value, "detail": one_line(r.detail), "data": dict(r.data),
             "elapsed_s": r.elapsed_s}
            for r in results
        ],
    }
    return json.dumps(doc, indent=2, default=str)


def add_subparser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `doctor` on the top-level parser's subparsers."""
    p = subparsers.add_parser(
        "doctor", help="pre-flight checks: etcd, clock, RDMA, NCCL environment, GPUs, checkpoint space; --bench: "
                       "device speed",
        description="Run pre-flight checks and print one row per check; exit 1 when a check failed.",
    )  # fmt: skip
    p.add_argument("--rdzv-endpoint", "--rdzv_endpoint", default="",
                   help="etcd endpoints host:port[,host:port...]; without it the etcd check is skipped")
    p.add_argument("--rdzv-conf", "--rdzv_conf", default="", help="k=v,... : ca_cert, cert, key, user, password")
    p.add_argument("--ntp-server", action="append", default=[],
                   help="NTP server host[:port] to measure the clock offset against (repeatable)")
    p.add_argument("--max-clock-offset", type=float, default=0.5,
                   help="seconds; a larger clock offset fails (default 0.5)")
    p.add_argument("--checkpoint-url", default=DEFAULT_CHECKPOINT_URL,
                   help=f"where checkpoints go: a path or fsspec URL (default {DEFAULT_CHECKPOINT_URL})")
    p.add_argument("--min-free-gb", type=float, default=10.0,
                   help="GiB that must be free at a local --checkpoint-url (default 10)")
    p.add_argument("--sysfs-root", default="/sys", help="sysfs mount to read RDMA ports and interfaces from")
    p.add_argument("--timeout", type=float, default=3.0,
                   help="seconds to wait for each etcd request and NTP query (default 3)")
    p.add_argument("--bench", action="store_true",
                   help="also time a matmul on every local device (GPUs, else the CPU); a device 1.5x slower "
                        "than the node's median fails")
    p.add_argument("--bench-seconds", type=float, default=2.0, help="seconds of matmuls per device (default 2)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON instead of the table")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Run every check and print the result; 0 when none failed, 1 otherwise."""
    out = sys.stdout if out is None else out
    options = options_from_args(args)
    results = run_doctor(options, DoctorSources(env=os.environ))
    print(render_json(results) if args.json else render_table(results), file=out)
    return 1 if failures(results) else 0
