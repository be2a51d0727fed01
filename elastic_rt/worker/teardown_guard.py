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
used after its group is destroyed, so nothing of value is lost. DDP modules are
found through a weak set filled by a wrapped `DistributedDataParallel.__init__`
(no heap scan; modules hidden by gc.freeze() are found too).

It acts inside `destroy_process_group()` only: a script that never calls it keeps
its groups registered until the interpreter exits, and this guard does nothing.

Installed in every worker by the worker entry point, before the user's script
imports torch; ELASTIC_RT_NO_TEARDOWN_GUARD=1 turns it off. It costs nothing until
torch.distributed is imported.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

from elastic_rt.worker.after_import import when_imported

ENV_DISABLE = "ELASTIC_RT_NO_TEARDOWN_GUARD"
_C10D_PACKAGE = "torch.distributed"
_DDP_MODULE = "torch.nn.parallel.distributed"
_MARK = "_elastic_rt_teardown_guard"

_live_ddp: "weakref.WeakSet[Any]" = weakref.WeakSet()


def release_ddp_reducers(group: Any = None, *, every_group: bool | None = None) -> int:
    """Drop the Reducer of every live DDP module on `group` (every group when `every_group`,
    which defaults to `group is None`); returns how many were dropped."""
    if every_group is None:
        every_group = group is None
    released = 0
    for module in list(_live_ddp):
        if not every_group and getattr(module, "process_group", None) is not group:
            continue
        attrs = module.__dict__
        if attrs.get("reducer") is None:
            continue
        attrs.pop("logger", None)  # the Logger holds the Reducer too
        attrs["reducer"] = None
        released += 1
    return released


def _wrap_destroy(dist: Any) -> None:
    c10d = getattr(dist, "distributed_c10d", None)
    if c10d is None:  # torch built without distributed support
        return
    original = c10d.destroy_process_group
    if getattr(original, _MARK, False):
        return

    @functools.wraps(original)
    def destroy_process_group(group=None):
        # torch destroys every group for None and for the default group itself.
        every = group is None or group is getattr(c10d.GroupMember, "WORLD", None)
        release_ddp_reducers(group, every_group=every)
        return original(group)

    setattr(destroy_process_group, _MARK, True)
    c10d.destroy_process_group = destroy_process_group
    if getattr(dist, "destroy_process_group", None) is original:
        dist.destroy_process_group = destroy_process_group


def _track_ddp(ddp_module: Any) -> None:
    cls = getattr(ddp_module, "DistributedDataParallel", None)
    if cls is None or getattr(cls.__init__, _MARK, False):
        return
    original = cls.__init__

    @functools.wraps(original)
    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        _live_ddp.add(self)

    setattr(__init__, _MARK, True)
    cls.__init__ = __init__


def install(environ=os.environ) -> bool:
    """Install the guard (now for modules already imported, else when they are); False if disabled.
    DDP modules created before install() are not tracked: install before the script imports torch."""
    if environ.get(ENV_DISABLE, "") not in ("", "0"):
        return False
    when_imported(_C10D_PACKAGE, _wrap_destroy)
    when_imported(_DDP_MODULE, _track_ddp)
    return True
