"""The Pod Security Standards (https://kubernetes.io/docs/concepts/security/pod-security-standards/),
version v1.31 (the oldest Kubernetes k8s/ supports), evaluated on a pod spec: the controls of the
baseline and restricted profiles with the fields and allowed values the standard defines. A pod meets
`privileged` always, `baseline` when no baseline control fails, `restricted` when no control fails."""

from __future__ import annotations

from enum import IntEnum
from typing import Iterator

VERSION = "v1.31"


class Level(IntEnum):
    PRIVILEGED = 0
    BASELINE = 1
    RESTRICTED = 2


# Baseline "Capabilities": what may be added beyond the runtime's default set.
BASELINE_CAPABILITIES = {"AUDIT_WRITE", "CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "KILL", "MKNOD",
                         "NET_BIND_SERVICE", "SETFCAP", "SETGID", "SETPCAP", "SETUID", "SYS_CHROOT"}
# Baseline "Sysctls": the safe set.
SAFE_SYSCTLS = {"kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
                "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
                "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
                "net.ipv4.tcp_keepalive_probes"}
SELINUX_TYPES = {"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"}
# Restricted "Volume Types".
RESTRICTED_VOLUMES = {"configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim",
                      "projected", "secret"}


def _containers(spec: dict) -> Iterator[tuple[str, dict]]:
    for kind in ("initContainers", "containers", "ephemeralContainers"):
        for c in spec.get(kind) or []:
            yield f"{kind}[{c.get('name')}]", c


def baseline_violations(spec: dict) -> list[str]:
    out = []
    psc = spec.get("securityContext") or {}
    if (psc.get("windowsOptions") or {}).get("hostProcess"):
        out.append("HostProcess: securityContext.windowsOptions.hostProcess")
    for field in ("hostNetwork", "hostPID", "hostIPC"):
        if spec.get(field):
            out.append(f"Host Namespaces: {field}")
    for v in spec.get("volumes") or []:
        if "hostPath" in v:
            out.append(f"HostPath Volumes: {v['name']}")
    if (psc.get("seccompProfile") or {}).get("type") == "Unconfined":
        out.append("Seccomp: pod seccompProfile Unconfined")
    se = psc.get("seLinuxOptions") or {}
    if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
        out.append(f"SELinux: pod seLinuxOptions {se}")
    if (psc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
        out.append("AppArmor: pod appArmorProfile")
    for s in psc.get("sysctls") or []:
        if s["name"] not in SAFE_SYSCTLS:
            out.append(f"Sysctls: {s['name']}")
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if (sc.get("windowsOptions") or {}).get("hostProcess"):
            out.append(f"HostProcess: {where}")
        if sc.get("privileged"):
            out.append(f"Privileged Containers: {where}")
        added = set((sc.get("capabilities") or {}).get("add") or []) - BASELINE_CAPABILITIES
        if added:
            out.append(f"Capabilities: {where} adds {sorted(added)}")
        for p in c.get("ports") or []:
            if p.get("hostPort"):
                out.append(f"Host Ports: {where} hostPort {p['hostPort']}")
        if (sc.get("seccompProfile") or {}).get("type") == "Unconfined":
            out.append(f"Seccomp: {where} Unconfined")
        se = sc.get("seLinuxOptions") or {}
        if se.get("type", "") not in SELINUX_TYPES or se.get("user") or se.get("role"):
            out.append(f"SELinux: {where} seLinuxOptions {se}")
        if (sc.get("appArmorProfile") or {}).get("type") not in (None, "RuntimeDefault", "Localhost"):
            out.append(f"AppArmor: {where} appArmorProfile")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"/proc Mount Type: {where} {sc['procMount']}")
    return out


def restricted_violations(spec: dict) -> list[str]:
    out = baseline_violations(spec)
    psc = spec.get("securityContext") or {}
    for v in spec.get("volumes") or []:
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            out.append(f"Volume Types: {v['name']} is {sorted(kinds)}")
    if psc.get("runAsUser") == 0:
        out.append("Running as Non-root user: pod runAsUser 0")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    for where, c in _containers(spec):
        sc = c.get("securityContext") or {}
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"Privilege Escalation: {where} allowPrivilegeEscalation is not false")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"Running as Non-root: {where} runAsNonRoot is not true")
        if sc.get("runAsUser") == 0:
            out.append(f"Running as Non-root user: {where} runAsUser 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in ("RuntimeDefault", "Localhost"):
            out.append(f"Seccomp: {where} seccompProfile {seccomp or 'unset'}")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"Capabilities: {where} does not drop ALL")
        extra = set(caps.get("add") or []) - {"NET_BIND_SERVICE"}
        if extra:
            out.append(f"Capabilities: {where} adds {sorted(extra)}")
    return out


def level_of(spec: dict) -> Level:
    """The most restrictive level the pod spec meets."""
    if not restricted_violations(spec):
        return Level.RESTRICTED
    if not baseline_violations(spec):
        return Level.BASELINE
    return Level.PRIVILEGED
