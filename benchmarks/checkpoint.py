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
# "fence check" is rank 0's check of its writer token before each elastic-rt commit
# (SaveStats.fence_check_s): the agent's fence file, as an elastic-rt agent keeps it for its workers
# (written here with a confirmation that does not lapse), and the writer lease (its clock, and one
# listing of the lease folder for a newer epoch).
# Deleting the previous output (for elastic-rt too: the directory is emptied, the manager kept) and
# flushing the disk (os.sync) happen untimed before each save.
#
#   python benchmarks/checkpoint.py [--size-gib 1] [--ranks 2] [--reps 3] [--dir DIR]
#
# Results go to benchmarks/results/checkpoint-DATE[-K].json and .txt, with the commit
# (benchmarks/provenance.py: a run on uncommitted changes is refused unless --allow-dirty) and the
# load average before and after (the machine is shared).

from __future__ import annotations

import argparse
import ctypes
import os
import shutil
import statistics
import tempfile
import time
from datetime import date
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.fence import FENCE_FILE, FenceState, write_fence
from elastic_rt.worker_env import ENV_HEARTBEAT_DIR, ENV_ROUND
from gloo_world import run_world  # benchmarks/gloo_world.py (this script's directory is on sys.path)
from provenance import provenance  # benchmarks/provenance.py
from results_file import write_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


SaveFn = Callable[[int], tuple[float, float, float]]  # save number -> (blocked_s, total_s, fence_check_s)


def publish_fence(directory: str) -> None:
    """The fence file an elastic-rt agent keeps for its workers (checkpoint/fence.py), confirmed for good:
    the managers then check it before every commit, as under `elastic-rt launch`."""
    os.makedirs(directory, exist_ok=True)
    write_fence(os.path.join(directory, FENCE_FILE), FenceState(
        run_id="bench", launch_id="1", round=0, confirmed_until_monotonic=time.monotonic() + 1e6, lease_ttl_s=3.0,
        agent_pid=os.getpid()))
    os.environ[ENV_HEARTBEAT_DIR], os.environ[ENV_ROUND] = directory, "0"


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
        def save(i: int) -> tuple[float, float, float]:
            elapsed, _ = timed(lambda: (fn(), dist.barrier()))
            return elapsed, elapsed, 0.0
        return save

    def dcp_async(path: str, reuse_stager: bool) -> SaveFn:
        stager = DefaultStager(StagingOptions(False, False, False, False)) if reuse_stager else None

        def save(i: int) -> tuple[float, float, float]:
            started = time.perf_counter()
            future = dcp.async_save(
                state, storage_writer=FileSystemWriter(path), process_group=ckpt_pg, async_stager=stager
            )
            blocked = time.perf_counter() - started
            future.result()
            dist.barrier()
            return blocked, time.perf_counter() - started, 0.0
        return save

    def elastic(mgr: CheckpointManager, guard: bool) -> SaveFn:
        optim = torch.optim.SGD(params, lr=0.0)  # no grads: step() changes nothing, but is guarded
        if guard:
            mgr.guard_optimizer(optim)

        def save(i: int) -> tuple[float, float, float]:
            started = time.perf_counter()
            mgr.save(i, state)
            if guard:
                simulated_compute(compute_s)
                optim.step()  # waits for staging if it is not done
            stats = mgr.wait()
            dist.barrier()
            total = time.perf_counter() - started
            return (stats.blocked_s if mgr.options.async_save else total), total, stats.fence_check_s
        return save

    def elastic_prepare(mgr: CheckpointManager, mgr_dir: str) -> Callable[[], None]:
        def remove() -> None:  # the checkpoints, not the manager's writer lease beside them
            if rank == 0:
                for name in os.listdir(mgr_dir):
                    if name.startswith("step_"):
                        shutil.rmtree(os.path.join(mgr_dir, name))
            dist.barrier()

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
    publish_fence(f"{root}/agent-{rank}")
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
    results: dict[str, list[tuple[float, float, float]]] = {name: [] for name in methods}
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
        fence = [max(r[name][i][2] for r in per_rank) for i in range(reps)]  # rank 0's: the others check nothing
        rows.append({
            "method": name,
            "blocked_s": statistics.median(blocked),
            "total_s": statistics.median(total),
            "throughput_gib_s": total_bytes / (1 << 30) / statistics.median(total),
            "fence_check_s": statistics.median(fence),
            "blocked_samples_s": blocked,
            "total_samples_s": total,
            "fence_check_samples_s": fence,
        })
    return rows


def report(rows: list[dict], args: argparse.Namespace, total_bytes: int) -> str:
    """The table and the ratios the docs quote, as text."""
    by_name = {r["method"]: r for r in rows}
    raw, sync, dcp_sync = (by_name.get(n) for n in ("raw write + fsync", "elastic-rt sync", "dcp.save"))
    lines = [f"{total_bytes / (1 << 30):.2f} GiB of state on {args.ranks} ranks, medians of {args.reps} saves "
             f"(after one warm-up), fsync on, simulated forward/backward {args.compute_s} s", ""]
    for r in rows:
        r["total_over_raw"] = r["total_s"] / raw["total_s"] if raw else None
        r["blocked_over_total"] = r["blocked_s"] / r["total_s"]
    lines.append(f"| {'method':24} | blocked s | total s | GiB/s | blocked / own total | total / raw | fence check ms |")
    lines.append(f"|{'-' * 26}|----------:|--------:|------:|--------------------:|------------:|---------------:|")
    for r in rows:
        vs_raw = f"{r['total_over_raw']:11.2f}" if raw else f"{'-':>11}"
        fence = f"{r['fence_check_s'] * 1e3:14.2f}" if r["method"].startswith("elastic-rt") else f"{'-':>14}"
        lines.append(f"| {r['method']:24} | {r['blocked_s']:9.3f} | {r['total_s']:7.3f} | {r['throughput_gib_s']:5.2f} "
                     f"| {r['blocked_over_total']:19.1%} | {vs_raw} | {fence} |")
    for name in ("elastic-rt async", "elastic-rt async+guard", "dcp.async_save", "dcp.async_save+stager"):
        if name in by_name and sync and dcp_sync:
            lines.append(f"{name}: blocked {by_name[name]['blocked_s'] / sync['total_s']:.1%} of an elastic-rt sync "
                         f"save, {by_name[name]['blocked_s'] / dcp_sync['total_s']:.1%} of a dcp.save")
    if sync and raw:
        lines.append(f"elastic-rt sync vs raw write: {sync['total_s'] / raw['total_s']:.2f}x (target <= 1.2x)")
    if sync:
        lines.append(f"fence check per elastic-rt sync save: {sync['fence_check_s'] * 1e3:.2f} ms, "
                     f"{sync['fence_check_s'] / sync['total_s']:.2%} of the save")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--compute-s", type=float, default=0.5, help="simulated forward/backward")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    parser.add_argument("--results-dir", default=os.path.join(REPO, "benchmarks", "results"),
                        help="where the results file goes (checkpoint-DATE[-K].json and .txt)")
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
    load_before = list(os.getloadavg())
    try:
        size = int(args.size_gib * (1 << 30))
        only = args.only.split(",") if args.only else None
        out = run_world(
            worker, args.ranks, root, size, args.reps, args.compute_s, only, args.keep_previous, timeout_s=3600
        )[0]
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    load_after = list(os.getloadavg())
    total_bytes = out["local_bytes"] * args.ranks
    rows = summarize(out["per_rank"], total_bytes)
    text = report(rows, args, total_bytes)
    text += (f"load average (1, 5, 15 min) before {', '.join(f'{x:.2f}' for x in load_before)}; after "
             f"{', '.join(f'{x:.2f}' for x in load_after)} ({os.cpu_count()} CPUs); code {prov['commit'][:12]}"
             f"{' (dirty)' if prov['dirty'] else ''}\n")
    payload = {"provenance": prov, "settings": {k: v for k, v in vars(args).items() if k != "results_dir"},
               "ranks": args.ranks, "bytes": total_bytes, "loadavg_before": load_before, "loadavg_after": load_after,
               "cpus": os.cpu_count(), "torch": torch.__version__, "rows": rows}
    write_results(args.results_dir, "checkpoint", date.today().isoformat(), payload, text)


if __name__ == "__main__":
    main()
