#!/usr/bin/env python3
"""Scale model: a discrete-event simulation of a first rendezvous round and a re-form, calibrated by measured costs.

Calibration comes from rows of a `rendezvous_scale.py` results file (etcd-v3 rows that met and re-formed):

  requests per node per round / per re-form   etcd's own request counters
  client CPU per node per round / per re-form the handler processes' CPU seconds, divided by N
  etcd CPU per request                        the members' CPU seconds over every request etcd received meanwhile
                                              (keep-alives and watch fan-out included, all members summed)

The simulation: every node makes its requests one after another; each is a slice of client CPU, a network
round trip and a slice of etcd CPU. The round closes when every node has made all but its last request (it
waits for the full group: the benchmark's last_call_timeout); the last request of each node follows the
closing write. A re-form is the same with the re-form's costs, N - 1 nodes and no first grant.

Two machines:
  here   clients and etcd share `cores` CPUs (one FIFO pool of that many servers), loopback round trips,
         minus the CPU the keep-alives take from the pool at the given lease TTL
  real   one agent per machine (client CPU never queues), etcd on `members` dedicated members of
         `cores_per_member` CPUs each. Every member applies every write, one at a time: the part of a
         write's CPU that is that serial apply (`serial_share`, an assumption) queues on one server; the
         rest, and every read, on the members' cores (the measured CPU is all members' summed, so a
         member's part is 1/members of it). A write also waits `write_latency_s` (raft's round trip to a
         quorum and the fsync of its batch; an assumption) without holding a CPU: batches share it.

    python benchmarks/scale_model.py benchmarks/results/rendezvous-scale-DATE.json [more.json ...]
"""

from __future__ import annotations

import argparse
import heapq
import json
import os
import statistics
import sys
from dataclasses import dataclass

WRITE_METHODS = ("Put", "Txn", "DeleteRange", "LeaseGrant", "LeaseRevoke")  # Txn: reads too; counted as writes


@dataclass(frozen=True, kw_only=True)
class Costs:
    """Per-node costs of one round and one re-form, and etcd's CPU per request."""

    req_per_round: float
    req_per_reform: float
    client_cpu_s_per_round: float
    client_cpu_s_per_reform: float
    etcd_cpu_s_per_request: float
    write_share: float  # of the requests, the share that are writes (raft's serial apply)
    keepalive_client_cpu_s: float  # per beat
    keepalive_etcd_cpu_s: float


@dataclass(frozen=True, kw_only=True)
class Machine:
    """Where the nodes and etcd run (see the module doc: `here` and `real`)."""

    shared_cores: int | None = None  # here: clients and etcd share these; None: every agent has its own machine
    members: int = 3
    cores_per_member: int = 8
    serial_share: float = 0.5  # of a write's etcd CPU, the part one member applies serially
    rtt_s: float = 0.0005
    write_latency_s: float = 0.002  # real: quorum round trip + the batch's fsync
    lease_ttl_s: float = 3.0


class _Pool:
    """`servers` FIFO servers; jobs must be offered in time order."""

    def __init__(self, servers: int, speed: float = 1.0) -> None:
        self._free = [0.0] * max(1, servers)
        self._speed = speed

    def serve(self, t: float, work_s: float) -> float:
        start = max(t, heapq.heappop(self._free))
        end = start + work_s / self._speed
        heapq.heappush(self._free, end)
        return end


def _phase(n: int, requests: float, client_cpu_s: float, costs: Costs, machine: Machine) -> float:
    """Seconds until every one of n nodes made `requests` requests, the last after all others' next-to-last.

    Each request is a chain of stages (client CPU, half a round trip, etcd's serial apply for a write, etcd
    CPU, half a round trip); every stage is offered to its pool in time order, so the pools stay FIFO."""
    steps = max(1, round(requests))
    client_slice = client_cpu_s / steps
    half_rtt = machine.rtt_s / 2
    if machine.shared_cores is not None:
        beat_s = machine.lease_ttl_s / 3
        busy = n * (costs.keepalive_client_cpu_s + costs.keepalive_etcd_cpu_s) / beat_s  # cores the beats take
        shared = _Pool(machine.shared_cores, max(0.05, 1.0 - busy / machine.shared_cores))
        client_pool, serial_pool, etcd_pool = shared, None, shared
        etcd_work, serial_work = costs.etcd_cpu_s_per_request, 0.0
    else:
        client_pool = None  # the agent's own machine: its CPU never queues
        serial_pool = _Pool(1)  # the apply loop every member runs over every write
        etcd_pool = _Pool(machine.members * machine.cores_per_member)
        per_member = costs.etcd_cpu_s_per_request / machine.members  # the summed CPU, spread over the members
        serial_work, etcd_work = per_member * machine.serial_share, per_member * (1 - machine.serial_share)

    def is_write(node: int, step: int) -> bool:
        return (node * steps + step) % 100 < costs.write_share * 100

    # (time, node, step, stage): 0 client CPU, 1 serial apply (writes, real), 2 etcd CPU, 3 reply on its way
    heap = [(0.0, i, 0, 0) for i in range(n)]
    heapq.heapify(heap)
    waiting: list[int] = []  # nodes that made all but their last request
    done_at = 0.0
    while heap:
        t, i, k, stage = heapq.heappop(heap)
        if stage == 0:
            end = client_pool.serve(t, client_slice) if client_pool is not None else t + client_slice
            nxt = 1 if serial_pool is not None and is_write(i, k) else 2
            heapq.heappush(heap, (end + half_rtt, i, k, nxt))
        elif stage == 1:
            heapq.heappush(heap, (serial_pool.serve(t + machine.write_latency_s, serial_work), i, k, 2))
        elif stage == 2:
            heapq.heappush(heap, (etcd_pool.serve(t, etcd_work) + half_rtt, i, k, 3))
        elif k + 1 < steps - 1:
            heapq.heappush(heap, (t, i, k + 1, 0))
        elif k + 1 == steps - 1:
            waiting.append(i)
            if len(waiting) == n:  # the round closes: every node makes its last request now
                for j in waiting:
                    heapq.heappush(heap, (t, j, steps - 1, 0))
        else:
            done_at = max(done_at, t)
    return done_at


def predict(n: int, costs: Costs, machine: Machine) -> dict:
    """Predicted seconds for n nodes to meet, and for n - 1 to re-form after one loss."""
    meet = _phase(n, costs.req_per_round, costs.client_cpu_s_per_round, costs, machine)
    reform = _phase(n - 1, costs.req_per_reform, costs.client_cpu_s_per_reform, costs, machine)
    return {"n": n, "meet_s": meet, "reform_s": reform}


def calibrate(rows: list[dict]) -> Costs:
    """Costs from results rows (medians over the rows that met and re-formed)."""
    good = [r for r in rows if r.get("kind") == "etcd-v3" and r.get("meet_s") is not None
            and r.get("reform_s") is not None and "reform_cpu_s" in r and r.get("round")]
    if not good:
        raise ValueError("no etcd-v3 row that met, re-formed and recorded its CPU (reform_cpu_s): "
                         "run benchmarks/rendezvous_scale.py first")

    def med(f) -> float:
        return statistics.median(f(r) for r in good)

    def total(reqs: dict) -> float:
        return sum(reqs.values())

    def writes(reqs: dict) -> float:
        return sum(v for k, v in reqs.items() if k in WRITE_METHODS)

    etcd_per_req = med(lambda r: (r["meet_cpu_s"]["etcd"] + r["reform_cpu_s"]["etcd"])
                       / max(1.0, total(r["round"]["requests"]) + total(r["reform_round"]["requests"])))
    idle_ms = med(lambda r: r.get("idle_client_cpu_ms_per_node_s", 0.0))
    idle_rate = med(lambda r: r["idle_req_per_node_s"])
    return Costs(
        req_per_round=med(lambda r: r["req_per_node_round"]),
        req_per_reform=max(1.0, med(lambda r: r["reform_req_per_node"])),
        client_cpu_s_per_round=med(lambda r: r["meet_cpu_s"]["clients"] / r["n"]),
        client_cpu_s_per_reform=med(lambda r: r["reform_cpu_s"]["clients"] / (r["n"] - 1)),
        etcd_cpu_s_per_request=etcd_per_req,
        write_share=med(lambda r: writes(r["round"]["requests"]) / max(1.0, total(r["round"]["requests"]))),
        keepalive_client_cpu_s=idle_ms / 1000 / max(idle_rate, 1e-9),  # the idle client CPU is the beats (and ticks)
        keepalive_etcd_cpu_s=etcd_per_req,
    )


def load_rows(paths: list[str]) -> tuple[list[dict], list[dict]]:
    """(rows, the etcd/host/provenance header of each file)."""
    rows, heads = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        rows += data["rows"]
        heads.append({"file": path, "etcd": data.get("etcd"), "provenance": data.get("provenance"),
                      "lease_ttl": data.get("settings", {}).get("rdzv_conf", {}).get("lease_ttl", "3")})
    return rows, heads


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="scale_model.py", description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="rendezvous_scale.py results (.json) to calibrate with and check against")
    p.add_argument("--nodes", default="1024,4096,16384", help="N values to predict on the real machine")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 2, help="this machine's CPUs (default: all)")
    p.add_argument("--cores-per-member", type=int, default=8, help="real etcd members' CPUs (default 8)")
    p.add_argument("--serial-share", type=float, default=0.5, help="of a write's etcd CPU, the serial apply (0.5)")
    p.add_argument("--rtt-ms", type=float, default=0.5, help="real network round trip (default 0.5 ms)")
    p.add_argument("--write-latency-ms", type=float, default=2.0,
                   help="real: a write's raft round trip and fsync, shared by its batch (default 2 ms)")
    p.add_argument("--out", default=None, help="write a results file here (benchmarks/results for docs figures)")
    a = p.parse_args(argv)
    try:
        rows, heads = load_rows(a.results)
        costs = calibrate(rows)
        nodes = [int(x) for x in a.nodes.split(",") if x]
    except (OSError, ValueError, KeyError) as exc:
        print(f"scale_model: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    ttl = float(heads[0]["lease_ttl"])
    here = Machine(shared_cores=a.cores, rtt_s=0.0001, write_latency_s=0.0, lease_ttl_s=ttl)
    real = Machine(cores_per_member=a.cores_per_member, serial_share=a.serial_share, rtt_s=a.rtt_ms / 1000,
                   write_latency_s=a.write_latency_ms / 1000, lease_ttl_s=ttl)
    checks = []
    for r in rows:
        if r.get("kind") == "etcd-v3" and r.get("meet_s") is not None:
            pr = predict(r["n"], costs, here)
            checks.append({"n": r["n"], "meet_s": r["meet_s"], "model_meet_s": pr["meet_s"],
                           "reform_s": r["reform_s"], "model_reform_s": pr["reform_s"]})
    preds = [predict(n, costs, real) for n in nodes]
    lines = [f"scale model, calibrated by {', '.join(h['file'] for h in heads)}",
             f"costs: {costs}", "", "here (shared cores), measured vs model:",
             "| nodes | meet s | model meet s | reform s | model reform s |", "|---|---|---|---|---|"]
    lines += [f"| {c['n']} | {c['meet_s']:.2f} | {c['model_meet_s']:.2f} "
              f"| {'-' if c['reform_s'] is None else format(c['reform_s'], '.2f')} | {c['model_reform_s']:.2f} |"
              for c in checks]
    lines += ["", f"real: one agent per machine, etcd on {real.members} members of {real.cores_per_member} CPUs, "
              f"serial share {real.serial_share:g} of a write, round trip {a.rtt_ms:g} ms, write latency "
              f"{a.write_latency_ms:g} ms, lease_ttl {ttl:g}:",
              "| nodes | model meet s | model reform s |", "|---|---|---|"]
    lines += [f"| {x['n']} | {x['meet_s']:.2f} | {x['reform_s']:.2f} |" for x in preds]
    text = "\n".join(lines) + "\n"
    if a.out is None:
        print(text)
        return 0
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import datetime

    from provenance import provenance
    from results_file import write_results

    payload = {"benchmark": "scale-model", "provenance": provenance(True), "calibration": heads,
               "costs": vars(costs), "here": vars(here), "real": vars(real), "checks": checks, "predictions": preds}
    write_results(a.out, "scale-model", datetime.date.today().isoformat(), payload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
