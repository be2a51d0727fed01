"""--numa-binding: torch's binding modes (torch/numa/binding.py), checked at launch, applied to warm workers too.

A cold worker is bound by torch itself: its command runs under `numactl --physcpubind=CPUS`,
CPUS being what torch computes for the GPU whose index is the worker's local rank. A warm
worker already runs when it learns its rank: the agent computes the same CPUS with torch's
function and hands them over with the start message; the worker binds every thread it has
(as torch binds a process that runs a function in place) before the script starts, and the
threads it starts later inherit the binding.
"""

from __future__ import annotations

import os
from typing import Iterable

from elastic_rt.errors import ConfigError


def numa_options(mode: str | None):
    """torch's NumaOptions for an --numa-binding mode (None: no binding)."""
    if mode is None:
        return None
    from torch.numa.binding import AffinityMode, NumaOptions

    return NumaOptions(affinity_mode=AffinityMode(mode))


def cpus_for_local_rank(options, local_rank: int) -> set[int] | None:
    """The logical CPUs torch binds local rank `local_rank` to; None when the binding failed and the options
    say to go on unbound (torch's should_fall_back_if_binding_fails), as torch's cold path does."""
    from elastic_rt.torch_seams import logical_cpus_to_bind

    try:
        return logical_cpus_to_bind(options, local_rank)
    except Exception:
        if options.should_fall_back_if_binding_fails:
            return None
        raise


def check_binding(mode: str, nproc_per_node: int) -> dict[int, set[int]]:
    """What each local rank will be bound to; ConfigError in one line when torch cannot bind one (no CUDA
    device for that local rank, no numactl, no CPU left for it)."""
    options = numa_options(mode)
    found: dict[int, set[int]] = {}
    for rank in range(nproc_per_node):
        try:
            cpus = cpus_for_local_rank(options, rank)
        except Exception as exc:
            raise ConfigError(f"--numa-binding {mode}: torch cannot bind local rank {rank} ({exc}); it binds a "
                              "worker to the CPUs near the GPU of its local rank, which needs a CUDA device per "
                              "local rank and numactl installed") from None
        if cpus:
            found[rank] = cpus
    return found


def cpu_list(cpus: Iterable[int]) -> str:
    """{0, 1, 2, 5} -> '0-2,5' (the form of numactl, taskset and /proc/PID/status)."""
    spans: list[list[int]] = []
    for cpu in sorted(set(cpus)):
        if spans and cpu == spans[-1][1] + 1:
            spans[-1][1] = cpu
        else:
            spans.append([cpu, cpu])
    return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in spans)


def bind_this_process(cpus: Iterable[int]) -> None:
    """Bind every thread of this process to `cpus`, except threads whose affinity was already set apart from
    the main thread's (torch's rule for a process it binds in place)."""
    wanted = set(cpus)
    original = os.sched_getaffinity(0)
    os.sched_setaffinity(0, wanted)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return
    for tid in tids:
        try:
            if os.sched_getaffinity(tid) == original:
                os.sched_setaffinity(tid, wanted)
        except OSError:  # the thread ended meanwhile
            pass
