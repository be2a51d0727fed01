"""A write throttle on chosen processes: their writes to one disk limited to N a second (a slow disk on demand, for
benchmarks: etcd's WAL fsyncs wait behind it). A cgroup of their own with io.max (cgroup v2) or
blkio.throttle.write_iops_device (v1) on the disk that holds a given path; needs root and a writable io (v2) or
blkio (v1) controller (`available()` says why not otherwise)."""

from __future__ import annotations

import os

from elastic_rt.chaos.cgroup import Cgroup, controller_root, creatable

_V1_ROOT = "/sys/fs/cgroup/blkio"
_V1_FILE = "blkio.throttle.write_iops_device"


def _root() -> tuple[str, int] | None:
    return controller_root("io", _V1_ROOT, _V1_FILE)


def unified() -> bool:
    """The throttle goes into a cgroup v2 hierarchy (where a process is in one cgroup only)."""
    found = _root()
    return found is not None and found[1] == 2


def disk_of(path: str, sys_root: str = "/sys") -> str:
    """'major:minor' of the whole disk that holds `path` (a partition's disk); ValueError when `path` is on no block
    device (tmpfs, overlay: nothing there to throttle)."""
    dev = os.stat(path).st_dev
    ident = f"{os.major(dev)}:{os.minor(dev)}"
    block = os.path.join(sys_root, "dev", "block", ident)
    if os.major(dev) == 0 or not os.path.exists(block):
        raise ValueError(f"{path} is on no single block device ({ident}: tmpfs, overlay or btrfs?): its writes "
                         "cannot be throttled")
    if os.path.exists(os.path.join(block, "partition")):  # a partition: the throttle is set on its disk
        with open(os.path.join(os.path.realpath(block), "..", "dev")) as f:
            return f.read().strip()
    return ident


def available(path: str) -> str | None:
    """None when writes to `path`'s disk can be throttled here, else why not."""
    if os.geteuid() != 0:
        return "throttling writes needs root (a cgroup of its own)"
    found = _root()
    if found is None:
        return "no cgroup io controller (v2 io.max or v1 blkio.throttle) under /sys/fs/cgroup"
    try:
        disk_of(path)
    except (OSError, ValueError) as exc:
        return str(exc)
    return creatable(found[0])


class WriteThrottle(Cgroup):
    """A cgroup whose processes make at most `iops` writes a second to the disk that holds `path`; processes join
    with add() or start in it with wrap(); close() moves the living ones back and removes it."""

    def __init__(self, iops: int, path: str, *, name: str | None = None) -> None:
        if iops < 1:
            raise ValueError(f"write throttle of {iops} IOPS: must be >= 1")
        found = _root()
        if found is None:
            raise RuntimeError(available(path) or "no cgroup io controller")
        root, self.version = found
        self.disk, self.iops = disk_of(path), iops
        super().__init__(root, name=name)
        try:
            self._write("io.max" if self.version == 2 else _V1_FILE,
                        f"{self.disk} wiops={iops}" if self.version == 2 else f"{self.disk} {iops}")
        except OSError:
            self.close()
            raise

    def writes(self) -> int | None:
        """Writes its processes made to the disk so far (None where the controller does not say)."""
        try:
            text = self._read("io.stat" if self.version == 2 else "blkio.throttle.io_serviced")
        except OSError:
            return None
        return writes_in(text, self.disk, self.version)


def writes_in(text: str, disk: str, version: int) -> int | None:
    """The writes to `disk` that a cgroup's io.stat (v2: "M:m rbytes=.. wbytes=.. rios=.. wios=N ...") or
    blkio.throttle.io_serviced (v1: "M:m Write N" among other lines) counts: 0 when the disk has no line yet, None
    when its line does not say."""
    for line in text.splitlines():
        parts = line.split()
        if not parts or parts[0] != disk:
            continue
        if version == 2:
            return next((int(p.partition("=")[2]) for p in parts[1:] if p.startswith("wios=")), None)
        if len(parts) == 3 and parts[1] == "Write":
            return int(parts[2])
    return 0
