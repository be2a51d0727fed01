"""Keep workers from deadlocking at exit in torch's gloo process-group destructor.

The hazard (torch 2.x, seen here as a worker that prints "done" and never exits,
so the job hangs in the exit barrier): a DistributedDataParallel module's C++
Reducer holds a reference to its process group. `destroy_process_group()` drops
the registry's reference, so the Reducer now holds the last one. When the module
is freed (typically as the training function returns), the Reducer's destructor
runs with the GIL held, destroys the group, and `~ProcessGroupGloo` joins its
worker threads. If one of those threads is still releasing a finished collective
whose tensor has a Python object (the usual `dist.all_reduce(flag)` pattern), it
needs the GIL to do so: both wait forever. Process groups themselves release the
GIL in their destructor; the Reducer binding does not.

The guard wraps `destroy_process_group` so that it first drops the Reducer (and
the Logger that holds it) of every DDP module on the groups being destroyed,
while the registry still owns the group. The group's last reference is then the
registry's, and that destructor runs without the GIL. A DDP module cannot be
used after its group is destroyed, so nothing of value is lost.

Installed in every worker by the worker entry point; ELASTIC_RT_NO_TEARDOWN_GUARD=1
turns it off. It costs nothing until torch.distributed is imported.
"""

from __future__ import annotations

import functools
import gc
import importlib.abc
import os
import sys

ENV_DISABLE = "ELASTIC_RT_NO_TEARDOWN_GUARD"
_TARGET = "torch.distributed"
_MARK = "_elastic_rt_teardown_guard"


def release_ddp_reducers(group=None) -> int:
    """Drop the Reducer of every live DDP module on `group` (None: every group); returns how many."""
    ddp_mod = sys.modules.get("torch.nn.parallel.distributed")
    if ddp_mod is None:
        return 0
    ddp_cls = ddp_mod.DistributedDataParallel
    released = 0
    for obj in gc.get_objects():
        if not issubclass(type(obj), ddp_cls):  # type(), not isinstance: no __class__ lookups
            continue
        if group is not None and getattr(obj, "process_group", None) is not group:
            continue
        attrs = obj.__dict__
        if attrs.get("reducer") is None:
            continue
        attrs.pop("logger", None)  # the Logger holds the Reducer too
        attrs["reducer"] = None
        released += 1
    return released


def _wrap(dist) -> None:
    c10d = dist.distributed_c10d
    original = c10d.destroy_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        release_ddp_reducers(group)
        return original(group)

    setattr(destroy_process_group, _MARK, True)
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


class _AfterImport(importlib.abc.MetaPathFinder):
    """Run `_wrap` once torch.distributed has finished importing."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                break
        else:
            return None
        loader = spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_and_wrap(module):
            exec_module(module)
            _remove_finder()
            if hasattr(module, "distributed_c10d"):  # torch built without distributed support has none
                _wrap(module)

        loader.exec_module = exec_and_wrap
        return spec


def _remove_finder() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _AfterImport)]


def install(environ=os.environ) -> bool:
    """Install the guard (now if torch.distributed is loaded, else when it is); False if disabled."""
    if environ.get(ENV_DISABLE, "") not in ("", "0"):
        return False
    dist = sys.modules.get(_TARGET)
    if dist is not None and hasattr(dist, "distributed_c10d"):
        _wrap(dist)
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport())
    return True
