"""recovery.py's failure-model scenarios: a 10 s etcd outage, a SIGSTOPped worker, a network partition.

Each runs the plain DDP script (tests/chaos/scripts/plain_ddp_steps.py, no elastic_rt import) with
recovery_harness.py's trial harness (Trial, Bench, _await_recovery) and returns a TrialResult:

etcd-outage  2 nodes x 2 workers on a fresh N-member etcd (--outage-etcd-members, default 3): every
             member SIGSTOPped for --outage-s, then SIGCONT. `extra` holds the steps/s in --window-s
             before, during and after, the training time lost (s) and the restarts seen.
             torchrun-control: the same job on c10d with nothing paused (it has no etcd), which
             shows how much "lost" time the load alone reads.
hang         1 node x 2 workers; local rank 1 SIGSTOPped; elastic-rt with --hang-timeout H. detect_s:
             to the agent's first reaction ("workers hung"); extra["beyond_timeout_s"] = detect_s - H.
partition    2 nodes x 1 worker (--nnodes 1:2); nodeB runs in a network namespace of its own joined to
             the host by a veth pair, and etcd and nodeA listen on the host end. Taking nodeB's link
             down cuts it from etcd and from its peer at once (nodeA's packets to it vanish).
             Needs root and `ip`.
"""

from __future__ import annotations

import os
import random
import signal
import statistics
import subprocess
import time

from recovery_harness import (PLAIN_SCRIPT, PLAIN_STEP_RE, REASON_RE, Deadline, Scenario, Trial, TrialFailed,
                              TrialResult, fmt)


def scenarios() -> list[Scenario]:
    return [
        Scenario("etcd-outage/ert", "etcd-outage", "elastic-rt", "etcd-v3", "all etcd members (SIGSTOP)"),
        Scenario("etcd-outage/torchrun-control", "etcd-outage", "torchrun", "c10d (no etcd)", "nothing (control)"),
        Scenario("hang/ert", "hang", "elastic-rt", "standalone, --hang-timeout", "local rank 1 (SIGSTOP)"),
        Scenario("hang/torchrun", "hang", "torchrun", "standalone (c10d)", "local rank 1 (SIGSTOP)"),
        Scenario("partition/ert", "partition", "elastic-rt", "etcd-v3", "nodeB: etcd + peer"),
        Scenario("partition/torchrun", "partition", "torchrun", "c10d (store on nodeA)", "nodeB: store + peer"),
    ]


def run_trial(bench, sc: Scenario, i: int) -> TrialResult:
    return {"etcd-outage": etcd_outage_trial, "hang": hang_trial, "partition": partition_trial}[sc.fault](bench, sc, i)


# ---- etcd outage ----------------------------------------------------------------------------------
def _collect(tr: Trial, until: float, steps: list, reasons: list, exits: list) -> None:
    """Read every node's output until monotonic `until`: rank 0's steps as (t, step), restarts, exits."""
    while True:
        try:
            ev = tr.next(until)
        except Deadline:
            return
        if ev.text is None:
            exits.append((ev.t, ev.src))
            continue
        m = PLAIN_STEP_RE.search(ev.text)
        if m:
            steps.append((ev.t, int(m[1])))
        m = REASON_RE.search(ev.text)
        if m:
            reasons.append((ev.t, f"{ev.src}: {m[1]}"))


def progress(steps: list[tuple[float, int]], t0: float, t1: float) -> int:
    """Steps that moved training forward in (t0, t1]: lines beyond the highest step seen so far (a
    restart without a checkpoint redoes steps, which is no progress)."""
    high, count = 0, 0
    for t, step in steps:
        if step > high:
            count += t0 < t <= t1
            high = step
    return count


def etcd_outage_trial(bench, sc: Scenario, i: int) -> TrialResult:
    from etcd_testbed.server import EtcdCluster, free_port

    a = bench.args
    etcd = EtcdCluster(a.outage_etcd_members).start() if sc.launcher == "elastic-rt" else None
    port = free_port()
    rdzv_id = f"{bench.run_tag}-{sc.label(i)}"
    try:
        with Trial(bench, sc.label(i)) as tr:
            endpoint = etcd.endpoints if etcd else None
            cmds = {n: bench.node_cmd(sc, rdzv_id, n, port, endpoint=endpoint, nnodes="2", nproc=2)
                    for n in ("nodeA", "nodeB")}
            store = None if etcd else ("127.0.0.1", port)
            rank0, cold = bench.start_pair(tr, cmds, time.monotonic(), store=store, world="4", step_re=PLAIN_STEP_RE)
            steps, reasons, exits = [], [], []
            t_before = time.monotonic()
            _collect(tr, t_before + a.window_s, steps, reasons, exits)
            t_stop = time.monotonic()
            try:
                for m in etcd.members if etcd else []:
                    os.kill(m.proc.pid, signal.SIGSTOP)
                _collect(tr, t_stop + a.outage_s, steps, reasons, exits)
            finally:
                for m in etcd.members if etcd else []:
                    os.kill(m.proc.pid, signal.SIGCONT)
            t_cont = time.monotonic()
            _collect(tr, t_cont + a.window_s, steps, reasons, exits)
            t_end = time.monotonic()
    finally:
        if etcd is not None:
            etcd.stop()
    rates = {"before": progress(steps, t_before, t_stop) / (t_stop - t_before),
             "during": progress(steps, t_stop, t_cont) / (t_cont - t_stop),
             "after": progress(steps, t_cont, t_end) / (t_end - t_cont)}
    if rates["before"] <= 0:
        raise TrialFailed(f"no step in the {a.window_s:g} s before the outage")
    done = progress(steps, t_stop, t_end)
    lost = (t_end - t_stop) - done / rates["before"]
    res = TrialResult("measured" if not exits else "crashed", rank0_node=rank0, cold_start_s=cold,
                      reasons=[r for _, r in reasons],
                      extra={"lost_s": lost, "restarts": len(reasons), "steps_per_s": rates,
                             "steps_in_window": done, "window_s": t_end - t_stop,
                             "etcd_members": a.outage_etcd_members if etcd else 0})
    if exits:
        res.detail = "; ".join(f"{src} exited {t - t_stop:.1f} s after the pause" for t, src in exits)
    return res


# ---- hang -----------------------------------------------------------------------------------------
def hang_trial(bench, sc: Scenario, i: int) -> TrialResult:
    a = bench.args
    with Trial(bench, sc.label(i)) as tr:
        t_start = time.monotonic()
        extra = ("--hang-timeout", f"{a.hang_timeout:g}")
        node = tr.start("node0", bench.worker_cmd(sc, f"{bench.run_tag}-{sc.label(i)}", extra))
        cold = bench.warm_up(tr, node, t_start, PLAIN_STEP_RE)
        victim = bench.find_worker(node, a.kill_local_rank, t_start + a.startup_timeout, PLAIN_SCRIPT)
        t_stop = time.monotonic()
        victim.send_signal(signal.SIGSTOP)
        res = TrialResult("timeout", victim=f"local rank {a.kill_local_rank} (pid {victim.pid})", cold_start_s=cold)
        res = bench._await_recovery(tr, res, t_stop, a.worker_timeout, survivor="node0", world=None,
                                    step_re=PLAIN_STEP_RE, restarted_by=_restarted)
    if res.detect_s is not None and sc.launcher == "elastic-rt":
        res.extra["beyond_timeout_s"] = res.detect_s - a.hang_timeout
    res.extra["hang_timeout_s"] = a.hang_timeout if sc.launcher == "elastic-rt" else None
    return res


def _restarted(text: str) -> bool:
    """A step of a restarted group: the plain script prints TORCHELASTIC_RESTART_COUNT (0 before the fault)."""
    m = PLAIN_STEP_RE.search(text)
    return bool(m) and int(m[3]) > 0


# ---- partition ------------------------------------------------------------------------------------
class NetNs:
    """A network namespace joined to the host by a veth pair (10.254.X.1 on the host, .2 inside);
    cut() takes the inside link down: the host's packets to it vanish, its own sends fail."""

    def __init__(self, tag: str) -> None:
        self.name = f"ertb-{tag}"
        self.host_if, self.ns_if = f"eb{tag}a", f"eb{tag}b"
        used = subprocess.run(["ip", "-o", "-4", "addr"], capture_output=True, text=True).stdout
        x = random.choice([n for n in range(1, 250) if f" 10.254.{n}." not in used])
        self.host_ip, self.ns_ip = f"10.254.{x}.1", f"10.254.{x}.2"

    def _ip(self, *args: str) -> None:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if proc.returncode != 0:
            raise TrialFailed(f"ip {' '.join(args)}: {proc.stderr.strip()} (the partition scenarios need root)")

    def __enter__(self) -> "NetNs":
        if os.geteuid() != 0:
            raise TrialFailed("the partition scenarios need root (network namespaces)")
        self._ip("netns", "add", self.name)
        try:
            self._ip("link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
            self._ip("link", "set", self.ns_if, "netns", self.name)
            self._ip("addr", "add", f"{self.host_ip}/24", "dev", self.host_if)
            self._ip("link", "set", self.host_if, "up")
            self._ip("-n", self.name, "addr", "add", f"{self.ns_ip}/24", "dev", self.ns_if)
            self._ip("-n", self.name, "link", "set", self.ns_if, "up")
            self._ip("-n", self.name, "link", "set", "lo", "up")
        except TrialFailed:
            self.__exit__()
            raise
        return self

    def prefix(self) -> list[str]:
        return ["ip", "netns", "exec", self.name]

    def cut(self) -> float:
        t = time.monotonic()
        self._ip("-n", self.name, "link", "set", self.ns_if, "down")
        return t

    def __exit__(self, *exc) -> None:
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, timeout=30)


def partition_trial(bench, sc: Scenario, i: int) -> TrialResult:
    from etcd_testbed.server import EtcdCluster, free_port

    a = bench.args
    rdzv_id = f"{bench.run_tag}-{sc.label(i)}"
    with NetNs(f"{os.getpid() % 10000:04d}{i}") as ns:
        etcd = EtcdCluster(1, host=ns.host_ip).start() if sc.launcher == "elastic-rt" else None
        try:
            port = free_port(ns.host_ip)
            endpoint = etcd.endpoints if etcd else f"{ns.host_ip}:{port}"
            with Trial(bench, sc.label(i)) as tr:
                # torch recognizes only its host name's addresses as its own: say which node hosts the store
                host = {n: () if etcd else ("--rdzv-conf", f"is_host={n == 'nodeA'}") for n in ("nodeA", "nodeB")}
                cmds = {"nodeA": bench.node_cmd(sc, rdzv_id, "nodeA", port, endpoint=endpoint, local_addr=ns.host_ip,
                                                extra=host["nodeA"]),
                        "nodeB": ns.prefix() + bench.node_cmd(sc, rdzv_id, "nodeB", port, endpoint=endpoint,
                                                              local_addr=ns.ns_ip, extra=host["nodeB"])}
                env = {"nodeA": {"GLOO_SOCKET_IFNAME": ns.host_if}, "nodeB": {"GLOO_SOCKET_IFNAME": ns.ns_if}}
                store = None if etcd else (ns.host_ip, port)
                rank0, cold = bench.start_pair(tr, cmds, time.monotonic(), store=store, world="2",
                                               step_re=PLAIN_STEP_RE, env=env)
                if rank0 != "nodeA":
                    raise TrialFailed(f"rank 0 on {rank0}, expected nodeA (the side that keeps etcd)")
                t_cut = ns.cut()
                res = TrialResult("timeout", victim="nodeB", rank0_node=rank0, cold_start_s=cold)
                return bench._await_recovery(tr, res, t_cut, a.node_timeout, survivor="nodeA", world="1",
                                             step_re=PLAIN_STEP_RE, restarted_by=_world1)
        finally:
            if etcd is not None:
                etcd.stop()


def _world1(text: str) -> bool:
    m = PLAIN_STEP_RE.search(text)
    return bool(m) and m[2] == "1"


# ---- summary --------------------------------------------------------------------------------------
def _med(vals: list) -> float | None:
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def outage_row(results: list[TrialResult]) -> dict:
    """The etcd-outage figures of one scenario: medians over its measured trials."""
    ok = [r for r in results if r.outcome == "measured"]
    rate = {k: _med([r.extra["steps_per_s"][k] for r in ok]) for k in ("before", "during", "after")}
    return {"median_lost_s": _med([r.extra["lost_s"] for r in ok]),
            "lost_s": [round(r.extra["lost_s"], 2) for r in ok],
            "restarts": [r.extra["restarts"] for r in results if r.outcome != "error"],
            "median_steps_per_s": rate}


def extra_targets(rows: dict[str, dict], hang_timeout: float) -> list[dict]:

    out = []
    if "etcd-outage/ert" in rows:
        r = rows["etcd-outage/ert"]
        out.append({"target": "etcd outage: no restart and no training time lost (median lost <= 1 s; goal 0)",
                    "met": r["restarts"] != [] and not any(r["restarts"]) and r["median_lost_s"] is not None
                    and r["median_lost_s"] <= 1.0 and "crashed" not in r["outcomes"],
                    "evidence": f"restarts {r['restarts']}, lost s {r['lost_s']}"})
    if "hang/ert" in rows:
        b = rows["hang/ert"]["median_beyond_timeout_s"]
        out.append({"target": "hang: detected within 1 s beyond --hang-timeout (median)",
                    "met": b is not None and b <= 1.0,
                    "evidence": f"{fmt(b, ' s')} beyond {hang_timeout:g} s"})
    if "partition/ert" in rows:
        d = rows["partition/ert"]["median_detect_s"]
        out.append({"target": "partition: the survivor re-forms within lease TTL + 2 s (5 s) of the cut",
                    "met": d is not None and d <= 5.0, "evidence": f"restart {fmt(d, ' s')} after the cut"})
    return out


def print_outage(rows: list[dict]) -> None:

    head = ["scenario", "rendezvous", "paused", "ok/n", "lost s", "lost s each", "steps/s before",
            "during", "after", "restarts", "notes"]
    lines = []
    for r in rows:
        s = r["median_steps_per_s"]
        notes = "; ".join(f"#{i + 1}: {x['outcome']}: {x['detail']}" for i, x in enumerate(r["results"]) if x["detail"])
        lines.append([r["scenario"], r["rendezvous"], r["kill"], f"{len(r['lost_s'])}/{r['trials']}",
                      fmt(r["median_lost_s"]), ",".join(map(str, r["lost_s"])) or "-", fmt(s["before"]),
                      fmt(s["during"]), fmt(s["after"]), ",".join(map(str, r["restarts"])) or "-", notes])
    widths = [max(len(str(x[i])) for x in [head] + lines) for i in range(len(head) - 1)]
    print("\netcd outage: training time lost = (window) - (steps done in it) / (steps/s before); "
          "window = the outage + the time after it")
    for row in [head] + lines:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)) + "  " + row[-1])
