"""torch's private seams: every private (underscore) name of torch that elastic-rt calls, patches, overrides or reads,
reached through this module or listed in SEAMS, and `broken_seams()`, which names each one a torch release changed."""

from __future__ import annotations

import contextlib
import importlib
import inspect
import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Iterator


@dataclass(frozen=True, kw_only=True)
class Seam:
    """One private name of torch: where it lives (`module` or `module:Class`), the name, what kind of thing
    elastic-rt relies on (a method with these parameters, an attribute its code sets, a module-level name),
    and which of elastic-rt's modules relies on it."""

    owner: str
    name: str
    kind: str  # "method", "attribute" (assigned as `.<name> = ` in the owner's or a base's source), "name"
    params: tuple[str, ...] | None = None  # a method's or function's parameters, when elastic-rt passes them
    used_by: str
    needs: str | None = None  # a build feature without which the seam cannot exist ("nccl")
    source: str | None = None  # an attribute's: the module that assigns it, where not the owner's classes

    @property
    def label(self) -> str:
        return f"{self.owner}.{self.name}" if ":" not in self.owner else f"{self.owner.split(':')[1]}.{self.name}"


_AGENT = "torch.distributed.elastic.agent.server.local_elastic_agent:LocalElasticAgent"
_CONTEXT = "torch.distributed.elastic.multiprocessing.api:SubprocessContext"
_WS = ("self", "worker_group")

SEAMS: tuple[Seam, ...] = (
    # the agent: torch's LocalElasticAgent, subclassed (agent/agent.py)
    *(Seam(owner=_AGENT, name=n, kind="method", params=_WS, used_by="agent/agent.py (overrides or calls it)")
      for n in ("_rendezvous", "_start_workers", "_stop_workers", "_initialize_workers", "_monitor_workers",
                "_restart_workers")),
    Seam(owner=_AGENT, name="_shutdown", kind="method", params=("self", "death_sig", "timeout"),
         used_by="agent/agent.py (overrides it)"),
    Seam(owner=_AGENT, name="_exit_barrier", kind="method", params=("self",), used_by="agent/agent.py (overrides it)"),
    Seam(owner=_AGENT, name="_invoke_run", kind="method", params=("self", "role"),
         used_by="agent/agent.py (overrides the monitor loop)"),
    *(Seam(owner=_AGENT, name=n, kind="attribute", used_by="agent/agent.py (reads it)")
      for n in ("_worker_group", "_remaining_restarts", "_pcontext")),
    # the worker processes: torch's SubprocessContext, subclassed for warm starts and wrapped for teardown aborts
    Seam(owner=_CONTEXT, name="_start", kind="method", params=("self",), used_by="agent/warm_start.py (overrides it)"),
    Seam(owner=_CONTEXT, name="_poll", kind="method", params=("self",), used_by="agent/warm_start.py (overrides it)"),
    Seam(owner=_CONTEXT, name="_capture_process_failures", kind="method", params=("self", "done_local_ranks"),
         used_by="agent/warm_start.py, diagnostics/exit_aborts.py (wraps it)"),
    *(Seam(owner=_CONTEXT, name=n, kind="attribute", used_by="agent/warm_start.py, diagnostics/exit_aborts.py")
      for n in ("_failures", "_running_local_ranks", "_numa_options")),
    Seam(owner="torch.distributed.elastic.multiprocessing.subprocess_handler:SubprocessHandler", name="_stdout",
         kind="attribute", used_by="agent/warm_start.py (a handler around a running process sets it)"),
    Seam(owner="torch.distributed.elastic.agent.server.local_elastic_agent", name="start_processes", kind="name",
         used_by="agent/warm_start.py (replaced while a group starts warm: patched_start_processes)"),
    Seam(owner="torch.distributed.elastic.multiprocessing.tail_log", name="tail_logfile", kind="name",
         params=("header", "file", "dst", "finished", "interval_sec", "log_line_filter"),
         used_by="agent/console_tee.py (replaced while a group starts: patched_tail_logfile)"),
    # point accesses, made here
    Seam(owner="torch.numa.binding", name="_get_validated_logical_cpus_to_bind_to", kind="name",
         params=("gpu_index", "numa_options"), used_by="worker/numa.py (logical_cpus_to_bind)"),
    Seam(owner="torch._C._distributed_c10d", name="_dump_fr_trace_json", kind="name",
         used_by="diagnostics/flight_recorder.py (flight_recorder_dump)"),
    Seam(owner="torch.distributed:ProcessGroupNCCL", name="Options", kind="name", needs="nccl",
         used_by="collectors/probe.py (nccl_options: its private _timeout)"),
    # checkpoints (their code keeps its imports; listed so that a torch change is named)
    Seam(owner="torch.distributed.checkpoint._traverse", name="set_element", kind="name",
         used_by="checkpoint/trust.py"),
    Seam(owner="torch._utils", name="_rebuild_tensor_v2", kind="name",
         used_by="checkpoint/tensor_read.py (the one constructor its unpickler allows)"),
    Seam(owner="torch.distributed.tensor:DTensor", name="_local_tensor", kind="attribute",
         source="torch.distributed.tensor._api", used_by="checkpoint/user_state.py"),
)


def _resolve(owner: str) -> Any:
    module, _, cls = owner.partition(":")
    obj = importlib.import_module(module)
    return getattr(obj, cls) if cls else obj


def _sets_attribute(seam: Seam, owner: Any) -> bool:
    """Whether torch's source assigns `.<name>` (`self._x = ...`, `self._x: T = ...`, `r._x = ...`)."""
    assigns = re.compile(rf"\.{re.escape(seam.name)}\b\s*(?::[^=\n]+)?=(?!=)")
    if seam.source is not None:
        sources = [importlib.import_module(seam.source)]
    else:
        sources = [klass for klass in owner.__mro__ if klass.__module__.startswith("torch")]
    for source in sources:
        try:
            if assigns.search(inspect.getsource(source)):
                return True
        except (OSError, TypeError):
            continue
    return False


def seam_problem(seam: Seam) -> str | None:
    """Why `seam` no longer holds in the installed torch, in one line naming it and its user; None when it holds."""
    where = f"torch's {seam.label} (used by elastic_rt/{seam.used_by})"
    try:
        owner = _resolve(seam.owner)
    except (ImportError, AttributeError) as exc:
        return f"{where}: {seam.owner} is gone ({exc})"
    if seam.kind == "attribute":
        return None if _sets_attribute(seam, owner) else f"{where}: no longer set by torch"
    target = getattr(owner, seam.name, None)
    if target is None:
        return f"{where}: gone"
    if seam.params is not None:
        params = tuple(inspect.signature(target).parameters)
        if params != seam.params:
            return f"{where}: parameters are now {params}, elastic-rt passes {seam.params}"
    return None


def broken_seams() -> list[str]:
    """One line per seam the installed torch broke (seams whose build feature is missing are not checked)."""
    return [p for seam in SEAMS if not _missing_feature(seam) for p in [seam_problem(seam)] if p]


def _missing_feature(seam: Seam) -> bool:
    if seam.needs == "nccl":
        import torch.distributed as dist

        return not hasattr(dist, "ProcessGroupNCCL")
    return False


# ---- the point accesses --------------------------------------------------------------------------------
def logical_cpus_to_bind(options: Any, local_rank: int) -> set[int]:
    """The logical CPUs torch's --numa-binding puts local rank `local_rank` on (raises as torch does)."""
    from torch.numa import binding

    return set(binding._get_validated_logical_cpus_to_bind_to(gpu_index=local_rank, numa_options=options))


def flight_recorder_dump() -> Callable[[], bytes] | None:
    """torch's flight recorder dump (JSON bytes), or None in a torch without distributed support or the recorder."""
    try:
        from torch._C._distributed_c10d import _dump_fr_trace_json
    except ImportError:
        return None
    return _dump_fr_trace_json


def nccl_options(timeout: timedelta) -> Any:
    """ProcessGroupNCCL options with `timeout` (torch exposes it only as the private `_timeout`)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    return opts


def process_failures(pcontext: Any) -> dict[int, Any] | None:
    """A SubprocessContext's failures so far by local rank (the dict itself: removing one forgives it); None
    when this torch keeps them elsewhere."""
    return getattr(pcontext, "_failures", None)


def wrap_failure_capture(pcontext: Any, wrap: Callable[[Callable[[set[int]], None]], Callable[[set[int]], None]]
                         ) -> bool:
    """Replace `pcontext`'s capture of finished workers' failures by wrap(original); False where this torch has no
    such step (nothing replaced)."""
    capture = getattr(pcontext, "_capture_process_failures", None)
    if capture is None or process_failures(pcontext) is None:
        return False
    pcontext._capture_process_failures = wrap(capture)
    return True


@contextlib.contextmanager
def patched_start_processes(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> Iterator[bool]:
    """While the block runs, torch's LocalElasticAgent starts workers through make(original start_processes);
    yields False (nothing patched) where this torch has no such module-level name."""
    from torch.distributed.elastic.agent.server import local_elastic_agent

    original = getattr(local_elastic_agent, "start_processes", None)
    if original is None:
        yield False
        return
    local_elastic_agent.start_processes = make(original)
    try:
        yield True
    finally:
        local_elastic_agent.start_processes = original


@contextlib.contextmanager
def patched_tail_logfile(replacement: Callable[..., None]) -> Iterator[bool]:
    """While the block runs, the TailLogs torch starts (its --tee) tail each file with `replacement` (called as
    torch calls tail_logfile); yields False (nothing patched) where this torch has no such module-level name."""
    from torch.distributed.elastic.multiprocessing import tail_log

    original = getattr(tail_log, "tail_logfile", None)
    if original is None:
        yield False
        return
    tail_log.tail_logfile = replacement
    try:
        yield True
    finally:
        tail_log.tail_logfile = original
