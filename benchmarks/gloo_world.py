"""A world of N spawned CPU processes in a gloo group (FileStore rendezvous), for benchmarks and tests."""

from __future__ import annotations

import io
import os
import queue
import signal
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


@dataclass(frozen=True, kw_only=True)
class RankResult:
    """What one rank's function returned, or the traceback it raised."""

    rank: int
    ok: bool
    value: Any = None
    error: str = ""


def _entry(fn: Callable[..., Any], rank: int, world_size: int, store_path: str, results: Any, args: tuple) -> None:
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        value = fn(rank, world_size, *args)
        # Tensors would travel as shared-memory handles that die with this process.
        buffer = io.BytesIO()
        torch.save(value, buffer)
        results.put(RankResult(rank=rank, ok=True, value=buffer.getvalue()))
    except BaseException:  # report everything, the parent decides
        results.put(RankResult(rank=rank, ok=False, error=traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


class World:
    """Start `fn(rank, world_size, *args)` in world_size spawned processes; fn must be importable
    (a module-level function). Use as a context manager: leftovers are killed on exit."""

    def __init__(self, fn: Callable[..., Any], world_size: int, *args: Any) -> None:
        self._ctx = mp.get_context("spawn")
        self._results = self._ctx.Queue()
        self._tmp = tempfile.TemporaryDirectory(prefix="elastic-rt-world-")
        store_path = os.path.join(self._tmp.name, "store")
        self.procs = [
            self._ctx.Process(
                target=_entry, args=(fn, rank, world_size, store_path, self._results, args), daemon=True
            )
            for rank in range(world_size)
        ]

    def start(self) -> "World":
        for proc in self.procs:
            proc.start()
        return self

    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[rank]
        if proc.pid is not None and proc.is_alive():
            os.kill(proc.pid, sig)
        proc.join(timeout=30)

    def results(self, *, timeout_s: float, ranks: list[int] | None = None) -> dict[int, RankResult]:
        """Results of `ranks` (default: all), waiting at most timeout_s in total."""
        wanted = set(range(len(self.procs)) if ranks is None else ranks)
        deadline = time.monotonic() + timeout_s
        got: dict[int, RankResult] = {}
        while wanted - set(got):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"ranks {sorted(wanted - set(got))} gave no result within {timeout_s} s")
            try:
                result = self._results.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                dead = [r for r in wanted - set(got) if not self.procs[r].is_alive()]
                if dead and self._results.empty():
                    codes = {r: self.procs[r].exitcode for r in dead}
                    raise RuntimeError(f"ranks exited without a result: {codes}") from None
                continue
            if result.ok:  # test-internal data from our own child process
                value = torch.load(io.BytesIO(result.value), weights_only=False)
                result = RankResult(rank=result.rank, ok=True, value=value)
            got[result.rank] = result
        return got

    def run(self, *, timeout_s: float) -> list[Any]:
        """Start, wait for every rank, and return their values; raise with the first traceback."""
        self.start()
        results = self.results(timeout_s=timeout_s)
        failed = [r for r in results.values() if not r.ok]
        if failed:
            raise RuntimeError(f"rank {failed[0].rank} failed:\n{failed[0].error}")
        return [results[r].value for r in range(len(self.procs))]

    def close(self) -> None:
        for proc in self.procs:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
            proc.join(timeout=30)
        self._tmp.cleanup()

    def __enter__(self) -> "World":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def run_world(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 180.0) -> list[Any]:
    """Run fn on every rank of a fresh gloo world; the ranks' return values in rank order."""
    with World(fn, world_size, *args) as world:
        return world.run(timeout_s=timeout_s)
