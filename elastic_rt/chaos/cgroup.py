"""A cgroup of its own for chosen processes (CPU quota, write throttle): created under a controller's root,
processes join with add() or start in it with wrap(), close() moves the living ones back and removes it. Needs
root and a writable controller."""

from __future__ import annotations

import os
import time
import uuid

_V2_ROOT = "/sys/fs/cgroup"  # the cgroup v2 hierarchy, where one is mounted


def controller_root(controller: str, v1_root: str, v1_file: str) -> tuple[str, int] | None:
    """Where cgroups of `controller` go, and the cgroup version: the v2 hierarchy where it gives its children that
    controller, else `v1_root` where that v1 hierarchy has `v1_file`; None when neither does."""
    if _v2_usable(_V2_ROOT, controller):
        return _V2_ROOT, 2
    if os.path.exists(os.path.join(v1_root, v1_file)):
        return v1_root, 1
    return None


def _v2_usable(root: str, controller: str) -> bool:
    """`root` is a cgroup v2 hierarchy whose children get `controller`."""
    try:
        with open(os.path.join(root, "cgroup.controllers")) as f:
            if controller not in f.read().split():
                return False
        with open(os.path.join(root, "cgroup.subtree_control")) as f:
            return controller in f.read().split()
    except OSError:
        return False


def creatable(root: str) -> str | None:
    """None when a cgroup can be created under `root`, else why not."""
    if os.geteuid() != 0:
        return "a cgroup of its own needs root"
    probe = os.path.join(root, f"elastic-rt-probe-{uuid.uuid4().hex[:8]}")
    try:
        os.mkdir(probe)
        os.rmdir(probe)
    except OSError as exc:
        return f"cannot create a cgroup under {root}: {exc}"
    return None


class Cgroup:
    """A new cgroup under `root` (named `name`, else a unique elastic-rt-test-... one)."""

    def __init__(self, root: str, *, name: str | None = None) -> None:
        self.path = os.path.join(root, name or f"elastic-rt-test-{uuid.uuid4().hex[:8]}")
        os.mkdir(self.path)
        self._parent_procs = os.path.join(root, "cgroup.procs")

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

    def _read(self, name: str) -> str:
        with open(os.path.join(self.path, name)) as f:
            return f.read()

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def __enter__(self):
        return self

    def __exit__(self, *_exc) -> None:
        self.close()
