"""Run a launcher (`python -m tests.support.numa_shim MODULE ARGS...`) on a machine without GPUs as if local
rank N drove GPU N on NUMA node 0, for --numa-binding tests.

torch binds a worker to the CPUs near the GPU of its local rank (torch/numa/binding.py); the GPU's NUMA
node comes from its PCI address, which needs CUDA. This answers that one question (node 0, and
$NUMA_SHIM_GPUS GPUs in all); the CPU sets (sysfs topology, the allowed CPUs), numactl and the binding
itself stay real, in the launcher process where torch computes them.
"""

from __future__ import annotations

import os
import runpy
import sys

from torch.numa import binding


def _numa_node_of_gpu(*, gpu_index: int) -> int:
    if not 0 <= gpu_index < _gpu_count():
        raise RuntimeError(f"no GPU {gpu_index}")
    return 0


def _gpu_count() -> int:
    return int(os.environ["NUMA_SHIM_GPUS"])


binding._get_numa_node_index_for_gpu_index = _numa_node_of_gpu
binding._get_gpu_count = _gpu_count

if __name__ == "__main__":
    module, sys.argv = sys.argv[1], sys.argv[1:]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
