"""Collective probe: one all-reduce across the nodes of a new round, timed (nccl-tests bus bandwidth)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from elastic_rt.errors import HealthCheckError


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    backend: str
    world_size: int
    nbytes: int
    latency_s: float

    @property
    def algbw_bytes_per_s(self) -> float:
        return self.nbytes / self.latency_s if self.latency_s > 0 else 0.0

    @property
    def busbw_bytes_per_s(self) -> float:
        """nccl-tests' all-reduce bus bandwidth: algbw * 2(n-1)/n."""
        n = self.world_size
        return self.algbw_bytes_per_s * (2.0 * (n - 1) / n) if n > 1 else 0.0


def pick_backend(requested: str = "auto") -> str:
    if requested == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if requested not in ("gloo", "nccl"):
        raise HealthCheckError(f"probe backend {requested!r}: choose auto, gloo or nccl")
    return requested


def run_allreduce_probe(store: dist.Store, rank: int, world_size: int, *, nbytes: int = 4 << 20,
                        timeout_s: float = 30.0, backend: str = "auto", iters: int = 3) -> ProbeResult:
    """All-reduce `nbytes` of float32 `iters` times on a private process group; report the median.

    The group is built directly on `store` (no global default group), so this runs in the
    agent while the workers use their own. A peer that does not take part makes the
    collective fail after timeout_s (HealthCheckError).
    """
    backend = pick_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    numel = max(1, nbytes // 4)
    try:
        if backend == "nccl":
            device = torch.device("cuda", torch.cuda.current_device())
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            pg = dist.ProcessGroupNCCL(store, rank, world_size, opts)
        else:
            device = torch.device("cpu")
            pg = dist.ProcessGroupGloo(store, rank, world_size, timeout)
        t = torch.ones(numel, dtype=torch.float32, device=device)
        pg.allreduce([t]).wait(timeout)  # warm-up: connections are set up lazily
        times = []
        for _ in range(iters):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            pg.allreduce([t]).wait(timeout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        expected = float(world_size) ** (iters + 1)
        if abs(float(t[0].item()) - expected) > 1e-3 * expected:
            raise HealthCheckError(f"probe all-reduce returned {t[0].item()} instead of {expected}")
    except HealthCheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend failure is a failed probe
        raise HealthCheckError(
            f"collective probe ({backend}, {world_size} nodes, {nbytes} bytes) failed: "
            f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"
        ) from exc
    finally:
        if "pg" in locals() and hasattr(pg, "shutdown"):
            try:
                pg.shutdown()
            except Exception:  # noqa: BLE001
                pass
    times.sort()
    return ProbeResult(backend=backend, world_size=world_size, nbytes=numel * 4, latency_s=times[len(times) // 2])
