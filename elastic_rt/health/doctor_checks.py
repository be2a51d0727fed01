"""Pre-flight checks for `elastic-rt doctor` and the agent: each takes its data sources and returns a CheckResult."""

from __future__ import annotations

import logging
import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterable, Mapping, Protocol, Sequence

from elastic_rt.errors import ElasticRTError, HealthCheckError

log = logging.getLogger(__name__)

GIB = 1024**3
_ACTIVE = 4  # IB logical port state 4: ACTIVE


class Status(str, Enum):
    OK = "ok"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


@dataclass(frozen=True, kw_only=True)
class CheckResult:
    """One row of the doctor's table; `data` holds the measured values for --json."""

    name: str
    status: Status
    detail: str
    data: Mapping[str, Any] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.status is Status.FAIL


def one_line(text: str) -> str:
    return " ".join(str(text).split())


def guarded(name: str, check: Callable[[], CheckResult]) -> CheckResult:
    """Run one check; any exception becomes a failed row with its message (never a traceback)."""
    try:
        return check()
    except ElasticRTError as exc:
        return CheckResult(name=name, status=Status.FAIL, detail=one_line(str(exc)))
    except Exception as exc:  # noqa: BLE001 - one broken check must not hide the others
        log.debug("doctor: check %s raised", name, exc_info=True)
        return CheckResult(name=name, status=Status.FAIL, detail=one_line(f"{type(exc).__name__}: {exc}"))


# ---- etcd -------------------------------------------------------------------


class EtcdProbe(Protocol):
    def status_latency_s(self) -> tuple[str, float]: ...


def probe_etcd(client: EtcdProbe, *, samples: int = 3) -> tuple[str, float]:
    """(version, best round trip of `samples` Status calls); the first call, which connects, is not counted."""
    version, first_s = client.status_latency_s()
    best = min([client.status_latency_s()[1] for _ in range(samples)], default=first_s)
    return version, best


def check_etcd(
    clients: Mapping[str, EtcdProbe] | None, *, samples: int = 3, warn_latency_s: float = 0.1
) -> CheckResult:
    """Every endpoint probed in parallel. fail: none answers; warn: some do not, or latency above warn_latency_s."""
    if not clients:
        return CheckResult(name="etcd", status=Status.SKIP, detail="no --rdzv-endpoint given")
    labels = list(clients)
    with ThreadPoolExecutor(max_workers=len(labels)) as pool:
        futures = {label: pool.submit(probe_etcd, clients[label], samples=samples) for label in labels}
    answers: dict[str, tuple[str, float]] = {}
    errors: dict[str, str] = {}
    for label, fut in futures.items():
        try:
            answers[label] = fut.result()
        except Exception as exc:  # noqa: BLE001 - reported per endpoint
            errors[label] = one_line(str(exc) if isinstance(exc, ElasticRTError) else f"{type(exc).__name__}: {exc}")
    data = {
        "endpoints": {
            label: {"version": answers[label][0], "latency_s": answers[label][1]} if label in answers
            else {"error": errors[label]}
            for label in labels
        }
    }
    if not answers:
        if len(labels) == 1:
            return CheckResult(name="etcd", status=Status.FAIL, detail=errors[labels[0]], data=data)
        return CheckResult(
            name="etcd", status=Status.FAIL, detail="no endpoint answered: " + "; ".join(errors.values()), data=data
        )
    parts, slow = [], []
    for label in labels:
        if label in answers:
            version, latency_s = answers[label]
            parts.append(f"{label} v{version} {latency_s * 1e3:.1f} ms")
            if latency_s > warn_latency_s:
                slow.append(label)
        else:
            parts.append(f"{label} unreachable")
    detail = ", ".join(parts)
    if errors:
        detail += f" ({len(errors)} of {len(labels)} endpoints down; the agent fails over to the others)"
    if slow:
        detail += f"; latency above {warn_latency_s * 1e3:g} ms slows rendezvous and leases"
    status = Status.WARN if errors or slow else Status.OK
    return CheckResult(name="etcd", status=status, detail=detail, data=data)


# ---- clock ------------------------------------------------------------------


def check_kernel_clock(read_timex: Callable[[], Any], *, max_offset_s: float) -> CheckResult:
    """adjtimex: unreadable or unsynchronized -> warn; synchronized but |offset| > max_offset_s -> fail."""
    try:
        st = read_timex()
    except HealthCheckError as exc:  # e.g. a seccomp profile that denies adjtimex
        return CheckResult(name="clock", status=Status.WARN, detail=f"cannot read the kernel clock state: {exc}")
    data = {
        "synchronized": st.synchronized,
        "offset_s": st.offset_s,
        "estimated_error_s": st.estimated_error_s,
        "max_error_s": st.max_error_s,
    }
    if not st.synchronized:
        return CheckResult(
            name="clock", status=Status.WARN, data=data,
            detail=f"kernel clock is not synchronized (adjtimex, max error {st.max_error_s:g} s); "
                   "is chronyd/ntpd running? measure with --ntp-server",
        )  # fmt: skip
    text = f"kernel clock synchronized, offset {st.offset_s * 1e3:+.3f} ms, est. error {st.estimated_error_s * 1e3:.3f} ms"
    if abs(st.offset_s) > max_offset_s:
        return CheckResult(
            name="clock", status=Status.FAIL, data=data,
            detail=f"{text}: above --max-clock-offset {max_offset_s:g} s",
        )  # fmt: skip
    return CheckResult(name="clock", status=Status.OK, detail=text, data=data)


def check_ntp(
    server: str, query: Callable[..., Any], *, max_offset_s: float, timeout_s: float, samples: int = 3
) -> CheckResult:
    """Offset against one NTP server (the exchange with the smallest round trip); above max_offset_s -> fail."""
    name = f"ntp {server}"
    results = []
    for _ in range(samples):
        try:
            results.append(query(server, timeout_s=timeout_s))
        except ElasticRTError:
            if not results:
                raise  # the server never answered: the row fails with the client's message
            break
    best = min(results, key=lambda r: r.round_trip_s)
    data = {"offset_s": best.offset_s, "round_trip_s": best.round_trip_s, "stratum": best.stratum}
    text = (
        f"offset {best.offset_s * 1e3:+.1f} ms (server minus local), "
        f"round trip {best.round_trip_s * 1e3:.1f} ms, stratum {best.stratum}"
    )
    if abs(best.offset_s) > max_offset_s:
        return CheckResult(
            name=name, status=Status.FAIL, data=data,
            detail=f"{text}: above --max-clock-offset {max_offset_s:g} s; fix time sync (chronyd/ntpd) on this node",
        )  # fmt: skip
    return CheckResult(name=name, status=Status.OK, detail=text, data=data)


# ---- RDMA and NCCL selection lists -------------------------------------------


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


def _port_label(p: Any) -> str:
    return f"{p.device}/{p.port}"


def nccl_ports(ports: Sequence[Any], env: Mapping[str, str]) -> list[Any]:
    """The ports NCCL would use: all of them, or those NCCL_IB_HCA selects."""
    hca = env.get("NCCL_IB_HCA", "").strip()
    if not hca:
        return list(ports)
    chosen = NcclList.parse(hca)
    return [p for p in ports if chosen.selects(p.device, p.port)]


def check_rdma(ports: Sequence[Any], env: Mapping[str, str], *, where: str = "sysfs") -> CheckResult:
    """A port that exists (and NCCL_IB_HCA selects) but is not ACTIVE fails; with NCCL_IB_DISABLE=1 it only warns."""
    if not ports:
        return CheckResult(name="rdma", status=Status.SKIP, detail=f"no RDMA ports under {where}")
    used = nccl_ports(ports, env)
    ignored = len(ports) - len(used)
    note = f" ({ignored} not selected by NCCL_IB_HCA)" if ignored else ""
    if not used:
        return CheckResult(
            name="rdma", status=Status.WARN,
            detail=f"NCCL_IB_HCA={env.get('NCCL_IB_HCA')} selects none of the {len(ports)} ports here",
        )  # fmt: skip
    bad, unknown, good = [], [], []
    for p in used:
        if p.state is None:
            unknown.append(f"{_port_label(p)} state unreadable")
        elif p.state[0] != _ACTIVE:
            phys = f", phys {p.phys_state[1]}" if p.phys_state else ""
            bad.append(f"{_port_label(p)} is {p.state[1] or p.state[0]}{phys}")
        else:
            rate = f" {p.rate_bytes_per_s * 8 / 1e9:g} Gb/s" if p.rate_bytes_per_s else ""
            good.append(f"{_port_label(p)}{rate} {p.link_layer or ''}".rstrip())
    data = {"active": len(good), "not_active": len(bad), "unknown": len(unknown), "not_selected": ignored}
    if bad:
        fix = "bring the link up, or leave the port out with NCCL_IB_HCA"
        if env.get("NCCL_IB_DISABLE", "").strip() == "1":
            return CheckResult(
                name="rdma", status=Status.WARN, data=data,
                detail=f"{'; '.join(bad)} (unused: NCCL_IB_DISABLE=1){note}",
            )  # fmt: skip
        return CheckResult(name="rdma", status=Status.FAIL, data=data, detail=f"{'; '.join(bad)}{note}; {fix}")
    if unknown:
        return CheckResult(name="rdma", status=Status.WARN, data=data, detail="; ".join(unknown + good) + note)
    return CheckResult(name="rdma", status=Status.OK, data=data, detail=f"{len(good)} ACTIVE: {', '.join(good)}{note}")


# ---- NCCL environment -------------------------------------------------------

_RELATED = ("CUDA_VISIBLE_DEVICES", "GLOO_SOCKET_IFNAME", "TORCH_DISTRIBUTED_DEBUG")


def nccl_environment(env: Mapping[str, str]) -> dict[str, str]:
    """NCCL_*, TORCH_NCCL_* and the few other variables that steer collectives."""
    return {
        k: env[k] for k in sorted(env)
        if k.startswith(("NCCL_", "TORCH_NCCL_")) or k in _RELATED
    }  # fmt: skip


def list_dir(path: str) -> list[str] | None:
    try:
        return sorted(os.listdir(path))
    except OSError:
        return None


def check_nccl_env(
    env: Mapping[str, str], *, interfaces: Sequence[str] | None, ports: Sequence[Any]
) -> CheckResult:
    """Report the variables; warn (never fail) on combinations that silently slow or hang training."""
    found = nccl_environment(env)
    warnings: list[str] = []
    active = [p for p in ports if p.state is not None and p.state[0] == _ACTIVE]
    if env.get("NCCL_IB_DISABLE", "").strip() == "1" and active:
        warnings.append(f"NCCL_IB_DISABLE=1 while {len(active)} RDMA ports are ACTIVE: NCCL will use TCP sockets")
    names = list(interfaces or ())
    for var in ("NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME"):
        value = env.get(var, "").strip()
        if not value or interfaces is None:
            continue
        wanted = NcclList.parse(value) if var.startswith("NCCL") else NcclList(
            exclude=False, exact=True, items=tuple((n.strip(), None) for n in value.split(",") if n.strip())
        )
        if wanted.exclude:
            if not [n for n in names if n != "lo" and wanted.selects(n)]:
                warnings.append(f"{var}={value} excludes every interface here ({', '.join(names)})")
        elif var.startswith("GLOO"):
            missing = [n for n, _ in wanted.items if n not in names]
            if missing:
                warnings.append(f"{var}={value}: no interface {', '.join(missing)} here (have {', '.join(names)})")
        elif not [n for n in names if wanted.selects(n)]:
            warnings.append(f"{var}={value} names no interface here (have {', '.join(names)})")
    hca = env.get("NCCL_IB_HCA", "").strip()
    if hca and ports and not NcclList.parse(hca).exclude and not nccl_ports(ports, env):
        devices = sorted({p.device for p in ports})
        warnings.append(f"NCCL_IB_HCA={hca} matches no RDMA device (have {', '.join(devices)})")
    for var in ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "NCCL_ASYNC_ERROR_HANDLING"):
        if env.get(var, "").strip() == "0":
            warnings.append(f"{var}=0: a failed collective hangs instead of aborting the worker")
    shown = " ".join(f"{k}={v if len(v) <= 40 else v[:37] + '...'}" for k, v in found.items())
    shown = shown or "no NCCL_* variables set (NCCL defaults)"
    data = {"variables": found, "warnings": warnings}
    if warnings:
        return CheckResult(name="nccl env", status=Status.WARN, data=data, detail=f"{'; '.join(warnings)}; set: {shown}")
    return CheckResult(name="nccl env", status=Status.OK, data=data, detail=shown)


# ---- GPUs and storage -------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class GpuInfo:
    names: tuple[str, ...]
    cuda_version: str | None  # of the torch build; None for a CPU-only build


def probe_gpus() -> GpuInfo:
    """What torch sees (imports torch: about a second)."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return GpuInfo(
        names=tuple(torch.cuda.get_device_name(i) for i in range(count)), cuda_version=torch.version.cuda
    )


def check_gpus(probe: Callable[[], GpuInfo], env: Mapping[str, str]) -> CheckResult:
    """GPUs visible -> ok; none while CUDA_VISIBLE_DEVICES asks for some -> fail; none at all -> warn (gloo on CPU)."""
    info = probe()
    data = {"count": len(info.names), "names": list(info.names), "cuda_version": info.cuda_version}
    if info.names:
        kinds = {n: info.names.count(n) for n in dict.fromkeys(info.names)}
        text = ", ".join(f"{c} x {n}" for n, c in kinds.items())
        return CheckResult(name="gpus", status=Status.OK, data=data, detail=f"{text} (CUDA {info.cuda_version})")
    build = f"torch built for CUDA {info.cuda_version}" if info.cuda_version else "torch is a CPU-only build"
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip() not in ("", "-1"):
        return CheckResult(
            name="gpus", status=Status.FAIL, data=data,
            detail=f"CUDA_VISIBLE_DEVICES={visible} but no CUDA device is visible ({build}); check the driver",
        )  # fmt: skip
    return CheckResult(
        name="gpus", status=Status.WARN, data=data, detail=f"no CUDA device visible ({build}); workers will use gloo on CPU"
    )


def nearest_existing(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.exists(path):
        parent = os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return path


def check_free_space(
    url: str, *, min_free_bytes: int, disk_usage: Callable[[str], Any] = shutil.disk_usage
) -> CheckResult:
    """Free space at a local checkpoint URL (or its nearest existing parent); other protocols are skipped."""
    from fsspec.core import split_protocol

    protocol, path = split_protocol(url)
    if protocol not in (None, "file", "local"):
        return CheckResult(name="checkpoint space", status=Status.SKIP, detail=f"cannot measure free space on {protocol}://")
    where = nearest_existing(path or ".")
    usage = disk_usage(where)
    data = {"path": where, "free_bytes": int(usage.free), "total_bytes": int(usage.total)}
    shown = os.path.abspath(path or ".")
    at = shown if where == shown else f"{shown} (not created yet; measured at {where})"
    text = f"{usage.free / GIB:.1f} GiB free of {usage.total / GIB:.1f} GiB at {at}"
    if usage.free < min_free_bytes:
        return CheckResult(
            name="checkpoint space", status=Status.FAIL, data=data,
            detail=f"{text}: below --min-free-gb {min_free_bytes / GIB:g}",
        )  # fmt: skip
    if not os.access(where, os.W_OK):
        return CheckResult(name="checkpoint space", status=Status.FAIL, data=data, detail=f"{text}: not writable")
    return CheckResult(name="checkpoint space", status=Status.OK, data=data, detail=text)


def failures(results: Iterable[CheckResult]) -> list[CheckResult]:
    return [r for r in results if r.failed]
