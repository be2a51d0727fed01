"""A CPU quota on chosen processes, as a container's CPU limit sets it: a slow rank or node on demand for
tests and benchmarks. A cgroup of their own with cpu.max (cgroup v2) or cpu.cfs_quota_us (v1); needs root
and a writable cpu controller (`available()` says why not otherwise)."""

from __future__ import annotations

import os

from elastic_rt.chaos.cgroup import Cgroup, controller_root, creatable

PERIOD_US = 100_000
_V1_ROOT = "/sys/fs/cgroup/cpu"


def _root() -> tuple[str, int] | None:
    return controller_root("cpu", _V1_ROOT, "cpu.cfs_quota_us")


def available() -> str | None:
    """None when a quota can be set here, else why not."""
    if os.geteuid() != 0:
        return "setting a CPU quota needs root (a cgroup of its own)"
    found = _root()
    if found is None:
        return "no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) under /sys/fs/cgroup"
    return creatable(found[0])


class CpuQuota(Cgroup):
    """A cgroup limited to `cpus` CPUs (0.2 = 20 ms of CPU time per 100 ms); processes join with add()
    or start in it with wrap(); close() moves the living ones back and removes it."""

    def __init__(self, cpus: float, *, name: str | None = None) -> None:
        found = _root()
        if found is None:
            raise RuntimeError(available() or "no cgroup cpu controller")
        root, self.version = found
        super().__init__(root, name=name)
        self.set(cpus)

    def set(self, cpus: float) -> None:
        """Change the limit (0 or less: none)."""
        quota = int(cpus * PERIOD_US) if cpus > 0 else -1
        if self.version == 2:
            self._write("cpu.max", f"{quota if quota > 0 else 'max'} {PERIOD_US}")
        else:
            self._write("cpu.cfs_period_us", str(PERIOD_US))
            self._write("cpu.cfs_quota_us", str(quota))
