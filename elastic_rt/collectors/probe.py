"""Collective probe: one all-reduce across the nodes of a new round, timed (nccl-tests bus bandwidth);
and the pre-flight ring test, each node sending to the next and receiving from the previous one, timed
per link.

The agent runs it in a child process (`python -m elastic_rt.collectors.probe`), one per node,
meeting on a TCPStore hosted by rank 0's child: a hung or crashed collective can then be
killed without touching the agent, and a CUDA context never stays in the agent. The child
lowers its own priority (os.nice) as it starts, before it imports torch (most of its CPU time):
no preexec_fn runs in the multi-threaded agent.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

from elastic_rt.errors import HealthCheckError

if TYPE_CHECKING:
    import torch.distributed as dist

PROBE_NICENESS = 10  # the probe competes with the node's training workers: let them go first

log = logging.getLogger(__name__)


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
    import torch

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
    import torch

    backend = pick_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    numel = max(1, nbytes // 4)
    what = f"collective probe ({backend}, {world_size} nodes, {nbytes} bytes)"
    with _private_group(store, rank, world_size, backend, timeout, what) as (pg, device):
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
    times.sort()
    return ProbeResult(backend=backend, world_size=world_size, nbytes=numel * 4, latency_s=times[len(times) // 2])


@contextlib.contextmanager
def _private_group(store: dist.Store, rank: int, world_size: int, backend: str, timeout: timedelta, what: str):
    """(process group, device) of a group of its own on `store`; any failure inside becomes a
    HealthCheckError naming `what`, and the group is shut down."""
    import torch
    import torch.distributed as dist

    pg = None
    try:
        if backend == "nccl":
            from elastic_rt.torch_seams import nccl_options

            pg = dist.ProcessGroupNCCL(store, rank, world_size, nccl_options(timeout))
            device = torch.device("cuda", torch.cuda.current_device())
        else:
            pg, device = dist.ProcessGroupGloo(store, rank, world_size, timeout), torch.device("cpu")
        yield pg, device
    except HealthCheckError:
        raise
    except Exception as exc:  # noqa: BLE001 - any backend failure is a failed test
        raise HealthCheckError(
            f"{what} failed: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}") from exc
    finally:
        if pg is not None:
            try:
                pg.shutdown()
            except Exception as exc:  # noqa: BLE001 - the result (or error) is already decided
                log.debug("%s: process group shutdown failed: %s", what, exc)


def run_ring_probe(store: dist.Store, rank: int, world_size: int, *, nbytes: int = 16 << 20,
                   timeout_s: float = 30.0, backend: str = "auto", iters: int = 3) -> float:
    """Send `nbytes` to the next rank while receiving as much from the previous one, `iters` times after
    a warm-up; returns the median seconds until the data from the previous rank was all here (the link
    previous -> this rank, measured at its receiving end)."""
    import torch

    backend = pick_backend(backend)
    timeout = timedelta(seconds=timeout_s)
    what = f"ring test ({backend}, {world_size} nodes, {nbytes} bytes)"
    with _private_group(store, rank, world_size, backend, timeout, what) as (pg, device):
        out = torch.full((max(1, nbytes // 4),), float(rank), dtype=torch.float32, device=device)
        into = torch.empty_like(out)
        nxt, prev = (rank + 1) % world_size, (rank - 1) % world_size
        times = []
        for i in range(iters + 1):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            send = pg.send([out], nxt, i)
            pg.recv([into], prev, i).wait(timeout)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if i:  # the first sets up the connections
                times.append(time.perf_counter() - t0)
            send.wait(timeout)
        if float(into[0].item()) != float(prev):
            raise HealthCheckError(f"ring test received {into[0].item()} from rank {prev} instead of {prev}")
    times.sort()
    return times[len(times) // 2]


def spawn_probe(*, master_addr: str, master_port: int, rank: int, world_size: int, nbytes: int,
                timeout_s: float, backend: str = "auto", ring: bool = False, nice: int = PROBE_NICENESS):
    """Run one probe (or the ring test: its link seconds) in a child process, by default at low priority;
    HealthCheckError when it fails or overruns."""
    cmd = [sys.executable, "-m", "elastic_rt.collectors.probe", "--master-addr", master_addr,
           "--master-port", str(master_port), "--rank", str(rank), "--world-size", str(world_size),
           "--bytes", str(nbytes), "--timeout", str(timeout_s), "--backend", backend, "--nice", str(nice),
           *(["--ring"] if ring else [])]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s + 60, start_new_session=True)
    except subprocess.TimeoutExpired as exc:
        raise HealthCheckError(f"collective probe did not finish within {timeout_s + 60:g} s") from exc
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        err = (proc.stderr.strip().splitlines() or [f"exit code {proc.returncode}"])[-1]
        raise HealthCheckError(err if err.startswith(("collective probe", "ring test")) else
                               f"{'ring test' if ring else 'collective probe'} failed: {err}")
    data = json.loads(lines[-1])
    return float(data["link_s"]) if ring else ProbeResult(**data)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m elastic_rt.collectors.probe")
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--bytes", type=int, default=4 << 20)
    p.add_argument("--timeout", type=float, default=30.0)
    p.add_argument("--backend", default="auto")
    p.add_argument("--nice", type=int, default=PROBE_NICENESS, help="added to this process's niceness first")
    p.add_argument("--ring", action="store_true", help="the ring test instead of the all-reduce probe")
    a = p.parse_args(argv)
    try:
        if a.nice:
            os.nice(a.nice)
    except OSError as exc:  # e.g. a negative value without CAP_SYS_NICE: probe at the given priority
        print(f"collective probe: cannot change priority by {a.nice} ({exc})", file=sys.stderr)
    import torch.distributed as dist  # after os.nice: the import is most of the probe's CPU time

    try:
        store = dist.TCPStore(a.master_addr, a.master_port, a.world_size, a.rank == 0,
                              timeout=timedelta(seconds=a.timeout), wait_for_workers=False)
        if a.ring:
            link_s = run_ring_probe(store, a.rank, a.world_size, nbytes=a.bytes, timeout_s=a.timeout,
                                    backend=a.backend)
            print(json.dumps({"link_s": link_s}), flush=True)
            return 0
        result = run_allreduce_probe(store, a.rank, a.world_size, nbytes=a.bytes, timeout_s=a.timeout,
                                     backend=a.backend)
    except HealthCheckError as exc:
        print(str(exc), file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - e.g. the store host is gone
        print(f"collective probe failed: {str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}",
              file=sys.stderr)
        return 1
    print(json.dumps(asdict(result)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
