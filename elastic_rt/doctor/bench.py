"""The pre-flight compute test: a matmul sized to the device, timed for a few seconds in a child process
per local rank (as the workers will run: one per GPU, or one per CPU worker with the workers' threads),
and the comparison of devices against their median.

A child per device keeps CUDA contexts out of the agent, lets a hung device be killed, and runs every
device at once, as training does (a node whose power or cooling cannot sustain all its GPUs shows).

    python -m elastic_rt.doctor.bench --device cpu --seconds 2     # one device, one JSON line
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable, Mapping, Sequence

from elastic_rt.errors import HealthCheckError

CPU_SIZE = 512  # float32: 0.27 GFLOP a matmul, 5-30 ms on one core
GPU_SIZE = 8192  # bfloat16: 1.1 TFLOP a matmul, ~1-3 ms on a datacenter GPU
MIN_WINDOWS = 5
# Matmuls are timed in windows of this long, not one by one: a CPU quota (a container's limit, CFS
# bandwidth, 100 ms periods by default) lets a matmul shorter than its slice run at full speed and stalls
# the process between slices, so the median single matmul would not show it. Two periods and more per
# window do, as training sees it.
WINDOW_S = 0.25


@dataclass(frozen=True, kw_only=True)
class ComputeResult:
    """One device's matmul: the median over `windows` windows of the seconds per matmul (`iters` in all)."""

    device: str
    size: int
    dtype: str
    iters: int
    seconds: float  # median per matmul
    windows: int = 0

    @property
    def tflops(self) -> float:
        return 2.0 * self.size**3 / self.seconds / 1e12 if self.seconds > 0 else 0.0

    def describe(self) -> str:
        rate = f"{self.tflops:.3g} TFLOP/s" if self.tflops >= 1 else f"{self.tflops * 1e3:.3g} GFLOP/s"
        return (f"{rate}: {self.seconds * 1e3:.3g} ms per {self.size}x{self.size} {self.dtype} matmul "
                f"(median of {self.windows} windows, {self.iters} matmuls)")


def per_op_seconds(op: Callable[[], object], seconds: float, *, window_s: float = WINDOW_S,
                   min_windows: int = MIN_WINDOWS, clock: Callable[[], float] = time.perf_counter
                   ) -> tuple[list[float], int]:
    """Run op() back to back for about `seconds` (at least `min_windows` windows, each of one op or more
    and at least `window_s`, shortened to fit min_windows into `seconds`): each window's seconds per op,
    and how many ops ran."""
    window_s = min(window_s, seconds / min_windows)
    windows: list[float] = []
    ops = 0
    end = clock() + seconds
    while len(windows) < min_windows or clock() < end:
        t0, n = clock(), 0
        while True:
            op()
            n += 1
            took = clock() - t0
            if took >= window_s:
                break
        windows.append(took / n)
        ops += n
    return windows, ops


def run_matmul(device: str, seconds: float, *, size: int | None = None,
               clock: Callable[[], float] = time.perf_counter) -> ComputeResult:
    """Multiply two random square matrices on `device` for about `seconds`."""
    import torch

    dev = torch.device(device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)
    dtype = torch.bfloat16 if cuda else torch.float32
    n = size or (GPU_SIZE if cuda else CPU_SIZE)
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)

    def one() -> None:
        torch.mm(a, b)
        if cuda:
            torch.cuda.synchronize(dev)

    one()  # warm-up: kernels, allocator, caches
    windows, ops = per_op_seconds(one, seconds, clock=clock)
    return ComputeResult(device=str(dev), size=n, dtype=str(dtype).removeprefix("torch."), iters=ops,
                         seconds=statistics.median(windows), windows=len(windows))


def local_devices(nproc: int, *, cuda_count: int | None = None) -> list[str]:
    """The device each local rank will train on: cuda:<local rank> when there are GPUs, else cpu."""
    if cuda_count is None:
        import torch

        cuda_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return [f"cuda:{r % cuda_count}" if cuda_count else "cpu" for r in range(nproc)]


def run_local(devices: Sequence[str], *, seconds: float, timeout_s: float,
              env: Mapping[str, str] | None = None) -> dict[int, ComputeResult]:
    """One child per local rank, all at once; {local rank: result}. HealthCheckError names a device that
    failed or overran timeout_s."""
    procs = []
    for rank, device in enumerate(devices):
        cmd = [sys.executable, "-m", "elastic_rt.doctor.bench", "--device", device, "--seconds", str(seconds)]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                      start_new_session=True, env=dict(env if env is not None else os.environ)))
    deadline = time.monotonic() + timeout_s
    out: dict[int, ComputeResult] = {}
    errors: list[str] = []
    try:
        for rank, proc in enumerate(procs):
            try:
                stdout, stderr = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                errors.append(f"local rank {rank} ({devices[rank]}): no result within {timeout_s:g} s")
                continue
            lines = stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                why = (stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
                errors.append(f"local rank {rank} ({devices[rank]}): {why}")
                continue
            out[rank] = ComputeResult(**json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    if errors:
        raise HealthCheckError("compute test failed: " + "; ".join(errors))
    return out


def slow_devices(seconds: Mapping[str, float], threshold: float) -> dict[str, float]:
    """{name: ratio} of those at least `threshold` x the (lower) median of all; none with fewer than 2."""
    values = [v for v in seconds.values() if v > 0]
    if len(values) < 2:
        return {}
    median = statistics.median_low(values)
    return {k: v / median for k, v in seconds.items() if v >= threshold * median}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastic_rt.doctor.bench")
    p.add_argument("--device", default="cpu")
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--size", type=int, default=0, help="matrix size (default: by device)")
    a = p.parse_args(argv)
    try:
        result = run_matmul(a.device, a.seconds, size=a.size or None)
    except Exception as exc:  # noqa: BLE001 - any device failure is a failed test, in one line
        print(f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}", file=sys.stderr)
        return 1
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
