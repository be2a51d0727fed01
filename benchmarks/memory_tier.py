"""The memory tier's costs: a snapshot every step beside a training step; a node-loss restore beside a raw TCP copy.

    python benchmarks/memory_tier.py [--gib 1.0] [--block-steps 15] [--rounds 3] [--every 1 5] [--out ...]

Two gloo ranks on CPU stand for two nodes (one rank each), each with a real replica server
(elastic_rt/agent/replica_server.py) over its own tier directory in /dev/shm. Each rank holds
`--gib` GiB of state: float32 parameters (plain tensors of its own: its node's share) and SGD's
momentum buffers, half each.

Part "snapshot": a tight loop (no sleep) of optimizer steps (torch's default thread count, as a
user leaves it) in blocks of `--block-steps`: without save() calls, then with a memory tier snapshot
every e steps for each `--every` (1 and 5 by default; async_save + guard_optimizer), `--rounds` times,
interleaved so the shared machine's load drift falls on all alike. Per configuration: the median and
the mean step time and their ratios to the blocks without snapshots (the mean is what throughput
pays: a snapshot that blocks a few steps hardly moves the median), the mean ratio again with the wait
for the snapshot still in flight at a block's end counted in (the true cost lies between the two),
the time the loop was blocked per snapshot (SaveStats.blocked_s), how many of the due snapshots were
taken (one due while the previous is in flight is skipped: snapshots coalesce) and the median steps
between two committed snapshots of one block (a failure loses at most about twice that). A snapshot
copies the state to host buffers (the only part the loop waits for: the optimizer step waits for the
copy), writes it into /dev/shm with its crc32 and sha256, and pushes it to the peer, all on the
background thread, which competes with the loop for the same cores.

Part "restore": node a is lost (server closed, its tier removed); a world of one rank on node b
loads the newest snapshot (its own files, and a's from the replica it holds) into a fresh state;
beside it, the same bytes sent over a TCP connection on loopback between two processes (raw copy
into a preallocated buffer). Ratio restore / raw copy.

The machine is shared: the load average before and after is recorded.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import shutil
import socket
import statistics
import tempfile
import time
from datetime import date

import torch

from elastic_rt.agent.replica_server import ReplicaServer, ReplicaServerConfig
from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.memory_tier import ENV_MEMORY_TIER_ADDR, ENV_MEMORY_TIER_DIR
from gloo_world import run_world  # benchmarks/gloo_world.py (this script's directory is on sys.path)
from provenance import provenance  # benchmarks/provenance.py
from results_file import write_results

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SECRET = b"memory-tier-benchmark"
TENSOR_ELEMS = 16 << 20  # 64 MiB float32 tensors


def _params(rank: int, gib: float) -> list[torch.Tensor]:
    """Half of `gib` as parameters: with SGD's momentum buffers the state is `gib`."""
    count = max(1, int(gib / 2 * (1 << 30) / (TENSOR_ELEMS * 4)))
    return [torch.full((TENSOR_ELEMS,), float(rank + i), requires_grad=True) for i in range(count)]


def _state(rank: int, params, opt, step: int) -> dict:
    return {"model": {f"rank{rank}.p{i}": p for i, p in enumerate(params)}, "optim": opt.state_dict(),
            "extra": {"step": step}}


def train(rank: int, world: int, url: str, secret_file: str, nodes, gib: float, block_steps: int, rounds: int,
          everies: list[int]) -> dict:
    """Blocks of `block_steps` optimizer steps, in the order no snapshot, every e for each e, `rounds` times
    (interleaved, so the load's drift falls on every configuration alike). One manager with memory_every=1;
    a block of `every e` calls save() on the steps divisible by e (what memory_every=e does). At each block's
    end the loop waits for the snapshot still in flight (drain_s, outside the step times)."""
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]
    params = _params(rank, gib)
    for p in params:
        p.grad = torch.full_like(p, 1e-3)  # the step's gradient (the loop times the optimizer + snapshot)
    opt = torch.optim.SGD(params, lr=0.01, momentum=0.9)
    saved: list[tuple[int, float]] = []
    mgr = CheckpointManager(url, async_save=True, memory_every=1, persist_every=10 ** 9, secret_file=secret_file,
                            collective_timeout_s=600.0, on_saved=lambda s: saved.append((s.step, s.blocked_s)))
    mgr.guard_optimizer(opt)
    opt.step()  # the optimizer's state and the staging buffers exist before the first timed step
    mgr.save(0, _state(rank, params, opt, 0))
    mgr.wait()
    saved.clear()
    out = {e: {"step_s": [], "drain_s": [], "blocks": []} for e in (0, *everies)}
    step = 0
    for _ in range(rounds):
        for every in (0, *everies):
            first = step + 1
            for _ in range(block_steps):
                step += 1
                started = time.perf_counter()
                opt.step()
                torch.distributed.barrier()  # the step's collective
                if every and step % every == 0:
                    mgr.save(step, _state(rank, params, opt, step))
                out[every]["step_s"].append(time.perf_counter() - started)
            started = time.perf_counter()
            mgr.wait()
            torch.distributed.barrier()
            out[every]["drain_s"].append(time.perf_counter() - started)
            out[every]["blocks"].append((first, step))
    mgr.close()
    for every, o in out.items():
        o["saved"] = [(s, b) for s, b in saved if any(a <= s <= z for a, z in o["blocks"])]
    return {"configs": {str(e): o for e, o in out.items()}, "threads": torch.get_num_threads()}


def restore(rank: int, world: int, url: str, secret_file: str, nodes, gib: float) -> dict:
    os.environ[ENV_MEMORY_TIER_DIR], os.environ[ENV_MEMORY_TIER_ADDR] = nodes[rank]
    model = {f"rank{r}.p{i}": torch.zeros(TENSOR_ELEMS) for r in range(2) for i in range(len(_params(0, gib)))}
    state = {"model": model, "extra": {"step": -1}}
    mgr = CheckpointManager(url, memory_every=1, persist_every=10 ** 9, secret_file=secret_file)
    started = time.perf_counter()
    step = mgr.load_latest(state)
    took = time.perf_counter() - started
    mgr.close()
    return {"step": step, "load_s": took, "from": mgr.restored_from,
            "bytes": sum(t.numel() * 4 for t in model.values())}


def _sink(port_q, nbytes: int, done_q) -> None:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    port_q.put(srv.getsockname()[1])
    conn, _ = srv.accept()
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        n = conn.recv_into(view[got:], min(4 << 20, nbytes - got))
        if not n:
            break
        got += n
    done_q.put(got)


def raw_tcp_copy_s(nbytes: int) -> float:
    """Seconds to send nbytes from this process to another over loopback TCP, into a preallocated buffer."""
    ctx = mp.get_context("spawn")
    port_q, done_q = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_sink, args=(port_q, nbytes, done_q))
    proc.start()
    port = port_q.get(timeout=60)
    data = memoryview(os.urandom(1 << 20))  # 1 MiB, sent repeatedly
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sent = 0
        while sent < nbytes:
            chunk = data[: min(len(data), nbytes - sent)]
            sock.sendall(chunk)
            sent += len(chunk)
        got = done_q.get(timeout=600)
    took = time.perf_counter() - started
    proc.join(timeout=60)
    assert got == nbytes
    return took


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="GiB of state per node (parameters + momentum)")
    p.add_argument("--block-steps", type=int, default=15, help="optimizer steps per block (a multiple of each --every)")
    p.add_argument("--rounds", type=int, default=3, help="blocks per configuration")
    p.add_argument("--every", type=int, nargs="+", default=[1, 5], help="memory_every values to run")
    p.add_argument("--reps", type=int, default=3, help="restore / raw copy repetitions")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"))
    p.add_argument("--allow-dirty", action="store_true")
    args = p.parse_args()
    prov = provenance(args.allow_dirty)
    load_before = list(os.getloadavg())
    tmp = tempfile.mkdtemp(prefix="elastic-rt-memtier-", dir="/dev/shm")
    secret_file = os.path.join(tmp, "secret")
    with open(secret_file, "wb") as f:
        f.write(SECRET)
    results: dict = {"gib_per_node": args.gib, "block_steps": args.block_steps, "rounds": args.rounds,
                     "every": args.every, "provenance": prov}
    try:
        url = f"file://{tmp}/ckpt"

        def servers():
            return [ReplicaServer(ReplicaServerConfig(directory=os.path.join(tmp, f"tier-{n}"), secret=SECRET,
                                                      node=n, max_replica_bytes=64 << 30)).start() for n in "ab"]

        srv = servers()
        nodes = [(s.config.directory, s.address) for s in srv]
        world = run_world(train, 2, url, secret_file, nodes, args.gib, args.block_steps, args.rounds, args.every,
                          timeout_s=3600)
        results["threads"] = world[0]["threads"]
        results["raw"] = world

        def steps(every: int) -> list[float]:
            return [s for r in world for s in r["configs"][str(every)]["step_s"]]

        def drained_mean(every: int) -> float:  # the mean step with the waits at the blocks' ends counted in
            return statistics.fmean((sum(r["configs"][str(every)]["step_s"]) + sum(r["configs"][str(every)]["drain_s"]))
                                    / len(r["configs"][str(every)]["step_s"]) for r in world)

        plain = steps(0)
        plain_med, plain_mean = statistics.median(plain), statistics.fmean(plain)
        results["plain"] = {"median_step_s": plain_med, "mean_step_s": plain_mean, "drained_mean_step_s": drained_mean(0)}
        results["snapshots"] = []
        for every in args.every:
            snap, conf = steps(every), world[0]["configs"][str(every)]
            taken = [step for step, _ in conf["saved"]]
            per_block = [[t for t in taken if lo <= t <= hi] for lo, hi in conf["blocks"]]
            gaps = [b - a for ts in per_block for a, b in zip(ts, ts[1:])]
            results["snapshots"].append({
                "every": every, "median_step_s": statistics.median(snap), "mean_step_s": statistics.fmean(snap),
                "median_ratio": statistics.median(snap) / plain_med, "mean_ratio": statistics.fmean(snap) / plain_mean,
                "drained_mean_ratio": drained_mean(every) / drained_mean(0),
                "blocked_s": statistics.median(b for r in world for _, b in r["configs"][str(every)]["saved"]),
                "taken": len(taken), "due": args.rounds * args.block_steps // every, "steps_between": gaps})
        srv[0].close()  # node a is lost: its server and its memory
        shutil.rmtree(nodes[0][0])
        loads = [run_world(restore, 1, url, secret_file, nodes[1:], args.gib, timeout_s=1800)[0]
                 for _ in range(args.reps)]
        nbytes = loads[0]["bytes"]  # the parameters restored (own memory + the lost node's replica)
        raw = [raw_tcp_copy_s(nbytes) for _ in range(args.reps)]
        load_med, raw_med = statistics.median(x["load_s"] for x in loads), statistics.median(raw)
        results["restore"] = {"load_s": load_med, "raw_tcp_copy_s": raw_med, "ratio": load_med / raw_med,
                              "replica_bytes": nbytes, "loads": loads, "raw": raw}
        srv[1].close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    results["load_before"], results["load_after"] = load_before, list(os.getloadavg())
    r = results["restore"]
    rows = [f"| every {x['every']} | {x['median_step_s']:.3f} ({x['median_ratio']:.2f}x) | {x['mean_step_s']:.3f} "
            f"({x['mean_ratio']:.2f}x) | {x['drained_mean_ratio']:.2f}x | {x['blocked_s']:.3f} | "
            f"{x['taken']} of {x['due']} | {statistics.median(x['steps_between']) if x['steps_between'] else '-'} |"
            for x in results["snapshots"]]
    text = "\n".join([
        f"memory tier, {args.gib:g} GiB of state per node (parameters + momentum), 2 nodes x 1 rank (gloo, CPU, "
        f"{results['threads']} torch threads per rank), {args.rounds} rounds of {args.block_steps}-step blocks "
        f"per configuration, interleaved; commit {prov['commit'][:10]}{' (dirty)' if prov['dirty'] else ''}",
        f"load average before {load_before[0]:.2f}, after {results['load_after'][0]:.2f} (2 shared cores)",
        "",
        "| snapshots (async + guard) | median step s (ratio) | mean step s (ratio) | mean ratio, drain counted | "
        "blocked per snapshot s | snapshots taken of due | median steps between snapshots |",
        "|---|---:|---:|---:|---:|---:|---:|",
        f"| no manager's save | {results['plain']['median_step_s']:.3f} | {results['plain']['mean_step_s']:.3f} | "
        "| | | |",
        *rows,
        "cost per step = mean ratio - 1 (goal < 2% at every 1); the two mean ratios bound it (a snapshot in flight at a block's end: left out, or waited for)",
        "",
        "| node-loss restore | median s |",
        "|---|---:|",
        f"| load_latest at world 1: the lost node's parameters from its replica, the survivor's from its memory "
        f"({r['replica_bytes'] / 2**30:.2f} GiB) | {r['load_s']:.3f} |",
        f"| raw TCP copy of the same bytes between two processes | {r['raw_tcp_copy_s']:.3f} |",
        f"| ratio | {r['ratio']:.2f} (goal <= 1.5) |",
        f"restored from: {sorted({x['from'] for x in r['loads']})}, step {sorted({x['step'] for x in r['loads']})}",
    ]) + "\n"
    write_results(args.out, "memory-tier", date.today().isoformat(), results, text)


if __name__ == "__main__":
    main()
