"""The doctor's etcd, clock, GPU and free-space checks; each takes its data sources as arguments."""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Protocol

from elastic_rt.checks.model import CheckResult, Status, describe_error
from elastic_rt.errors import ElasticRTError, HealthCheckError

GIB = 1024**3


# ---- etcd -------------------------------------------------------------------


class EtcdProbe(Protocol):
    def status_latency_s(self) -> tuple[str, float]: ...


def probe_etcd(client: EtcdProbe, *, samples: int = 3) -> tuple[str, float]:
    """(version, best round trip of `samples` Status calls); the first call, which connects, is not counted."""
    version, first_s = client.status_latency_s()
    best = min([client.status_latency_s()[1] for _ in range(samples)], default=first_s)
    return version, best


def known_etcd_bug(version: str) -> str | None:
    """What is known to go wrong with this etcd version under elastic-rt (None: nothing)."""
    parts = version.split(".")
    if len(parts) >= 3 and parts[0] == "3" and parts[1] == "5" and parts[2].isdigit() and int(parts[2]) <= 4:
        return ("etcd 3.5.0-3.5.4 members crash when a client's read-only transaction ends while they read it "
                "(etcd-io/etcd#14110): elastic-rt does not end one at its deadline, but an agent killed mid-read can; "
                "upgrade etcd to 3.5.5 or later")
    return None


def check_etcd(
    clients: Mapping[str, EtcdProbe] | None, *, samples: int = 3, warn_latency_s: float = 0.1
) -> CheckResult:
    """Every endpoint probed in parallel. fail: none answers; warn: some do not, latency above warn_latency_s, or a
    version with a known bug (known_etcd_bug)."""
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
            errors[label] = describe_error(exc)
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
    bugs = sorted({bug for version, _ in answers.values() if (bug := known_etcd_bug(version)) is not None})
    for bug in bugs:
        detail += f"; {bug}"
    status = Status.WARN if errors or slow or bugs else Status.OK
    return CheckResult(name="etcd", status=status, detail=detail, data=data)


# ---- clock ------------------------------------------------------------------


def check_kernel_clock(read_timex: Callable[[], Any], *, max_offset_s: float, ntp_given: bool = False) -> CheckResult:
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
                   "is chronyd/ntpd running?" + ("" if ntp_given else " measure with --ntp-server"),
        )  # fmt: skip
    text = (
        f"kernel clock synchronized, offset {st.offset_s * 1e3:+.3f} ms, "
        f"est. error {st.estimated_error_s * 1e3:.3f} ms"
    )
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
        name="gpus", status=Status.WARN, data=data,
        detail=f"no CUDA device visible ({build}); workers will use gloo on CPU",
    )  # fmt: skip


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
        detail = f"cannot measure free space on {protocol}://"
        return CheckResult(name="checkpoint space", status=Status.SKIP, detail=detail)
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
