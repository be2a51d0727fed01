"""The doctor's RDMA-port row and its NCCL environment check."""

from __future__ import annotations

import os
from typing import Any, Mapping, Sequence

from elastic_rt.checks.model import CheckResult, Status
from elastic_rt.checks.rdma import NcclList, nccl_ports, port_active, rdma_verdict


def _port_label(p: Any) -> str:
    return f"{p.device}/{p.port}"


def check_rdma(ports: Sequence[Any], env: Mapping[str, str], *, where: str = "sysfs") -> CheckResult:
    """The RDMA-port rule (elastic_rt.checks.rdma) as the doctor's row: a port NCCL would use that is not ACTIVE
    fails; with NCCL_IB_DISABLE=1 it only warns."""
    verdict = rdma_verdict(ports, env)
    if verdict.status is Status.SKIP:
        return CheckResult(name="rdma", status=Status.SKIP, detail=f"no RDMA ports under {where}")
    ignored = verdict.not_selected
    note = f" ({ignored} not selected by NCCL_IB_HCA)" if ignored else ""
    if not verdict.used:
        return CheckResult(
            name="rdma", status=Status.WARN,
            detail=f"NCCL_IB_HCA={env.get('NCCL_IB_HCA')} selects none of the {len(ports)} ports here",
        )  # fmt: skip
    bad = [f"{_port_label(p)} is {p.state[1] or p.state[0]}" + (f", phys {p.phys_state[1]}" if p.phys_state else "")
           for p in verdict.down]
    unknown = [f"{_port_label(p)} state unreadable" for p in verdict.unreadable]
    good = [f"{_port_label(p)}{f' {p.rate_bytes_per_s * 8 / 1e9:g} Gb/s' if p.rate_bytes_per_s else ''} "
            f"{p.link_layer or ''}".rstrip() for p in verdict.active]
    data = {"active": len(good), "not_active": len(bad), "unknown": len(unknown), "not_selected": ignored}
    if bad:
        if verdict.ib_disabled:
            return CheckResult(
                name="rdma", status=Status.WARN, data=data,
                detail=f"{'; '.join(bad)} (unused: NCCL_IB_DISABLE=1){note}",
            )  # fmt: skip
        fix = "bring the link up, or leave the port out with NCCL_IB_HCA"
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
    active = [p for p in ports if port_active(p)]
    if env.get("NCCL_IB_DISABLE", "").strip() == "1" and active:
        ports_text = "1 RDMA port is" if len(active) == 1 else f"{len(active)} RDMA ports are"
        warnings.append(f"NCCL_IB_DISABLE=1 while {ports_text} ACTIVE: NCCL will use TCP sockets")
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
        detail = f"{'; '.join(warnings)}; set: {shown}"
        return CheckResult(name="nccl env", status=Status.WARN, data=data, detail=detail)
    return CheckResult(name="nccl env", status=Status.OK, data=data, detail=shown)
