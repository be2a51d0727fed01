"""Checkpoint benchmark: training-loop blocked time and write throughput per save, side by side."""

# One run, on N ranks (gloo, CPU), each holding 1/N of about --size-gib of sharded state
# (DTensor, Shard(0)). Compared, each with --reps timed saves after one warm-up save:
#
#   raw write + fsync   each rank writes its bytes to one file and fsyncs (the disk's limit)
#   torch.save          each rank torch.save()s its shards to its own file, then fsync
#   dcp.save            torch.distributed.checkpoint.save, FileSystemWriter (fsync on)
#   dcp.async_save      default staging (a fresh host copy per save)
#   dcp.async_save+stager  one DefaultStager (no pinned memory: CPU) reused for every save
#   elastic-rt sync     CheckpointManager(async_save=False)
#   elastic-rt async    CheckpointManager(async_save=True): staged in save() into reused buffers
#   elastic-rt async+guard  ... and guard_optimizer(): staging overlaps a simulated
#                       forward/backward of --compute-s; blocked = save() + wait at optimizer.step()
#
# "blocked" is the time the training loop could not proceed (max over ranks), "total" the time
# until the checkpoint was complete on storage; throughput = state bytes / total. Medians.
# Deleting the previous output (for elastic-rt too: the directory is emptied, the manager kept) and
# flushing the disk (os.sync) happen untimed before each save.
#
#   python benchmarks/checkpoint.py [--size-gib 1] [--ranks 2] [--reps 3] [--dir DIR]

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import statistics
import tempfile
import time
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from elastic_rt.checkpoint import CheckpointManager
from gloo_world import run_world  # benchmarks/gloo_world.py (this script's directory is on sys.path)
from provenance import provenance  # benchmarks/provenance.py


TENSORS_PER_RANK = 8


def make_state(rank: int, world_size: int, size_bytes: int) -> tuple[dict, list[torch.nn.Parameter]]:
    mesh = init_device_mesh("cpu", (world_size,))
    per_tensor = size_bytes // world_size // TENSORS_PER_RANK
    cols = 4096
    rows = per_tensor // 4 // cols
    gen = torch.Generator().manual_seed(rank)
    params = []
    for _ in range(TENSORS_PER_RANK):
        local = torch.randn(rows, cols, generator=gen)
        params.append(
            torch.nn.Parameter(
                DTensor.from_local(
                    local, mesh, [Shard(0)], run_check=False,
                    shape=torch.Size((rows * world_size, cols)), stride=(cols, 1),
                )
            )
        )
    return {"model": {f"layer{i}.weight": p for i, p in enumerate(params)}}, params


def local_bytes(params: list[torch.nn.Parameter]) -> int:
    return sum(p._local_tensor.numel() * p._local_tensor.element_size() for p in params)


def raw_write(path: str, params: list[torch.nn.Parameter]) -> None:
    with open(path, "wb") as f:
        for p in params:
            t = p._local_tensor
            nbytes = t.numel() * t.element_size()
            f.write(memoryview((ctypes.c_char * nbytes).from_address(t.data_ptr())).cast("B"))
        f.flush()
        os.fsync(f.fileno())


def torch_save(path: str, params: list[torch.nn.Parameter]) -> None:
    with open(path, "wb") as f:
        torch.save({f"layer{i}": p._local_tensor for i, p in enumerate(params)}, f)
        f.flush()
        os.fsync(f.fileno())


def simulated_compute(seconds: float) -> None:
    """A forward/backward stand-in: real matmuls for about `seconds`."""
    a = torch.randn(256, 256)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        a = torch.tanh(a @ a)


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    started = time.perf_counter()
    value = fn()
    return time.perf_counter() - started, value


SaveFn = Callable[[int], tuple[float, float]]  # save number -> (blocked_s, total_s)


def worker(
    rank: int, world_size: int, root: str, size_bytes: int, reps: int, compute_s: float, only: list[str] | None,
    keep_previous: bool = False,
) -> dict:
    torch.set_num_threads(1)
    state, params = make_state(rank, world_size, size_bytes)
    ckpt_pg = dist.new_group(backend="gloo")
    # name -> (prepare: untimed, e.g. delete the previous output; save: timed)
    methods: dict[str, tuple[Callable[[], None], SaveFn]] = {}

    def remover(path: str) -> Callable[[], None]:
        def remove() -> None:
            if rank == 0 and os.path.exists(path):
                shutil.rmtree(path)
            dist.barrier()
            os.makedirs(path, exist_ok=True)
        return remove

    def sync_method(fn: Callable[[], None]) -> SaveFn:
        def save(i: int) -> tuple[float, float]:
            elapsed, _ = timed(lambda: (fn(), dist.barrier()))
            return elapsed, elapsed
        return save

    def dcp_async(path: str, reuse_stager: bool) -> SaveFn:
        stager = DefaultStager(StagingOptions(False, False, False, False)) if reuse_stager else None

        def save(i: int) -> tuple[float, float]:
            started = time.perf_counter()
            future = dcp.async_save(
                state, storage_writer=FileSystemWriter(path), process_group=ckpt_pg, async_stager=stager
            )
            blocked = time.perf_counter() - started
            future.result()
            dist.barrier()
            return blocked, time.perf_counter() - started
        return save

    def elastic(mgr: CheckpointManager, guard: bool) -> SaveFn:
        optim = torch.optim.SGD(params, lr=0.0)  # no grads: step() changes nothing, but is guarded
        if guard:
            mgr.guard_optimizer(optim)

        def save(i: int) -> tuple[float, float]:
            started = time.perf_counter()
            mgr.save(i, state)
            if guard:
                simulated_compute(compute_s)
                optim.step()  # waits for staging if it is not done
            stats = mgr.wait()
            dist.barrier()
            total = time.perf_counter() - started
            return (stats.blocked_s if mgr.options.async_save else total), total
        return save

    def elastic_prepare(mgr: CheckpointManager, mgr_dir: str) -> Callable[[], None]:
        remove = remover(mgr_dir)

        def prepare() -> None:
            # Like the other methods' output, the previous checkpoint goes before the timed save
            # (the manager keeps its buffers), unless --keep-previous: then it stays, as in
            # training, and the file system must find blocks for the new one elsewhere.
            mgr.latest_committed_step()  # waits for the manager's own background retention
            if not keep_previous:
                remove()
        return prepare

    paths = {n: os.path.join(root, n) for n in ("raw", "torch_save", "dcp", "dcp_async", "dcp_async_stager")}
    methods["raw write + fsync"] = (
        remover(paths["raw"]), sync_method(lambda: raw_write(f"{paths['raw']}/r{rank}.bin", params))
    )
    methods["torch.save"] = (
        remover(paths["torch_save"]), sync_method(lambda: torch_save(f"{paths['torch_save']}/r{rank}.pt", params))
    )
    methods["dcp.save"] = (remover(paths["dcp"]), sync_method(
        lambda: dcp.save(state, storage_writer=FileSystemWriter(paths["dcp"]), process_group=ckpt_pg)
    ))
    methods["dcp.async_save"] = (remover(paths["dcp_async"]), dcp_async(paths["dcp_async"], False))
    methods["dcp.async_save+stager"] = (
        remover(paths["dcp_async_stager"]), dcp_async(paths["dcp_async_stager"], True)
    )
    managers = []
    for name, async_save, guard in (
        ("elastic-rt sync", False, False),
        ("elastic-rt async", True, False),
        ("elastic-rt async+guard", True, True),
    ):
        mgr_dir = f"{root}/ert_{int(async_save)}{int(guard)}"
        mgr = CheckpointManager(f"file://{mgr_dir}", keep_last=1, async_save=async_save, per_rank_keys=())
        managers.append(mgr)
        methods[name] = (elastic_prepare(mgr, mgr_dir), elastic(mgr, guard))

    if only:
        methods = {name: methods[name] for name in only}
    # Round robin, rotated by one method each round, so that drift in the shared machine's speed
    # and after-effects of the method before (freed memory, writeback) hit every method alike.
    # Before each timed save the previous output is deleted and the disk flushed (os.sync), untimed.
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in methods}
    names = list(methods)
    for i in range(reps + 1):  # the first round is a warm-up
        shift = i % len(names)
        for name in names[shift:] + names[:shift]:
            prepare, save = methods[name]
            dist.barrier()
            prepare()
            os.sync()
            dist.barrier()
            sample = save(i)
            if i > 0:
                results[name].append(sample)
    for mgr in managers:
        mgr.close()
    gathered: list[Any] = [None] * world_size
    dist.all_gather_object(gathered, results)
    return {"per_rank": gathered, "local_bytes": local_bytes(params)}


def summarize(per_rank: list[dict], total_bytes: int) -> list[dict]:
    rows = []
    for name in per_rank[0]:
        reps = len(per_rank[0][name])
        blocked = [max(r[name][i][0] for r in per_rank) for i in range(reps)]
        total = [max(r[name][i][1] for r in per_rank) for i in range(reps)]
        rows.append({
            "method": name,
            "blocked_s": statistics.median(blocked),
            "total_s": statistics.median(total),
            "throughput_gib_s": total_bytes / (1 << 30) / statistics.median(total),
            "blocked_samples_s": blocked,
            "total_samples_s": total,
        })
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compute-s", type=float, default=0.5, help="simulated forward/backward")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", default=None, help="also write the results here")
    parser.add_argument("--only", default=None, help="comma-separated method names, in this order")
    parser.add_argument("--keep-previous", action="store_true",
                        help="elastic-rt: keep the previous checkpoint while saving (retention deletes it "
                             "after the commit, as in training) instead of deleting it untimed before")
    parser.add_argument("--allow-dirty", action="store_true",
                        help="run on a working tree with uncommitted changes (recorded in the results)")
    args = parser.parse_args()
    prov = provenance(args.allow_dirty)
    root = args.dir or tempfile.mkdtemp(prefix="elastic-rt-bench-")
    os.makedirs(root, exist_ok=True)
    try:
        size = int(args.size_gib * (1 << 30))
        only = args.only.split(",") if args.only else None
        out = run_world(
            worker, args.ranks, root, size, args.reps, args.compute_s, only, args.keep_previous, timeout_s=3600
        )[0]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    total_bytes = out["local_bytes"] * args.ranks
    rows = summarize(out["per_rank"], total_bytes)
    by_name = {r["method"]: r for r in rows}
    raw, sync, dcp_sync = (by_name.get(n) for n in ("raw write + fsync", "elastic-rt sync", "dcp.save"))
    print(f"\n{total_bytes / (1 << 30):.2f} GiB of state on {args.ranks} ranks, medians of {args.reps} saves "
          f"(after one warm-up), fsync on, simulated forward/backward {args.compute_s} s\n")
    for r in rows:
        r["total_over_raw"] = r["total_s"] / raw["total_s"] if raw else None
        r["blocked_over_total"] = r["blocked_s"] / r["total_s"]
    print(f"| {'method':24} | blocked s | total s | GiB/s | blocked / own total | total / raw |")
    print(f"|{'-' * 26}|----------:|--------:|------:|--------------------:|------------:|")
    for r in rows:
        vs_raw = f"{r['total_over_raw']:11.2f}" if raw else f"{'-':>11}"
        print(f"| {r['method']:24} | {r['blocked_s']:9.3f} | {r['total_s']:7.3f} | {r['throughput_gib_s']:5.2f} "
              f"| {r['blocked_over_total']:19.1%} | {vs_raw} |")
    for name in ("elastic-rt async", "elastic-rt async+guard", "dcp.async_save", "dcp.async_save+stager"):
        if name in by_name and sync and dcp_sync:
            print(f"{name}: blocked {by_name[name]['blocked_s'] / sync['total_s']:.1%} of an elastic-rt sync "
                  f"save, {by_name[name]['blocked_s'] / dcp_sync['total_s']:.1%} of a dcp.save")
    if sync and raw:
        print(f"elastic-rt sync vs raw write: {sync['total_s'] / raw['total_s']:.2f}x (target <= 1.2x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"provenance": prov, "settings": {k: v for k, v in vars(args).items() if k != "json"},
                       "ranks": args.ranks, "bytes": total_bytes, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
