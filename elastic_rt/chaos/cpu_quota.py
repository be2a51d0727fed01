"""A CPU quota on chosen processes, as a container's CPU limit sets it: a slow rank or node on demand for
tests and benchmarks. A cgroup of their own with cpu.max (cgroup v2) or cpu.cfs_quota_us (v1); needs root
and a writable cpu controller (`available()` says why not otherwise)."""

from __future__ import annotations

import os
import time
import uuid

PERIOD_US = 100_000
_V2_ROOT = "/sys/fs/cgroup"
_V1_ROOT = "/sys/fs/cgroup/cpu"


def _v2_usable(root: str) -> bool:
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            if "cpu" not in f.read().split():
                return False
        with open(os.path.join(root, "cgroup.subtree_control")) as f:
            return "cpu" in f.read().split()
    except OSError:
        return False


def _root() -> tuple[str, int] | None:
    if _v2_usable(_V2_ROOT):
        return _V2_ROOT, 2
    if os.path.exists(os.path.join(_V1_ROOT, "cpu.cfs_quota_us")):
        return _V1_ROOT, 1
    return None


def available() -> str | None:
    """None when a quota can be set here, else why not."""
    if os.geteuid() != 0:
        return "setting a CPU quota needs root (a cgroup of its own)"
    found = _root()
    if found is None:
        return "no cgroup cpu controller (v2 cpu.max or v1 cpu.cfs_quota_us) under /sys/fs/cgroup"
    probe = os.path.join(found[0], f"elastic-rt-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as exc:
        return f"cannot create a cgroup under {found[0]}: {exc}"
    return None


class CpuQuota:
    """A cgroup limited to `cpus` CPUs (0.2 = 20 ms of CPU time per 100 ms); processes join with add()
    or start in it with wrap(); close() moves the living ones back and removes it."""

    def __init__(self, cpus: float, *, name: str | None = None) -> None:
        found = _root()
        if found is None:
            raise RuntimeError(available() or "no cgroup cpu controller")
        root, self.version = found
        self.path = os.path.join(root, name or f"elastic-rt-test-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        self._parent_procs = os.path.join(root, "cgroup.procs")
        self.set(cpus)

    def set(self, cpus: float) -> None:
        """Change the limit (0 or less: none)."""
        quota = int(cpus * PERIOD_US) if cpus > 0 else -1
        if self.version == 2:
            self._write("cpu.max", f"{quota if quota > 0 else 'max'} {PERIOD_US}")
        else:
            self._write("cpu.cfs_period_us", str(PERIOD_US))
            self._write("cpu.cfs_quota_us", str(quota))

    def add(self, pid: int) -> None:
        self._write("cgroup.procs", str(pid))

    def wrap(self, cmd: list[str]) -> list[str]:
        """`cmd` run by a shell that first moves itself into this cgroup (children inherit it)."""
        procs = os.path.join(self.path, "cgroup.procs")
        return ["sh", "-c", f'echo $$ > {procs} && exec "$@"', "sh", *cmd]

    def pids(self) -> list[int]:
        try:
            with open(os.path.join(self.path, "cgroup.procs")) as f:
                return [int(x) for x in f.read().split()]
        except OSError:
            return []

    def close(self, timeout_s: float = 30.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            for pid in self.pids():
                try:
                    with open(self._parent_procs, "w") as f:
                        f.write(str(pid))
                except OSError:
                    pass  # exited meanwhile
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                if time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def __enter__(self) -> "CpuQuota":
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
