"""The recovery benchmark's trial harness: launchers' commands, one trial's processes and output, the kill and the
wait for the first step after recovery. benchmarks/recovery.py runs it; failure_scenarios.py and warm_restart.py
build on it."""

from __future__ import annotations

import argparse
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field

import psutil

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.append(REPO)  # etcd_testbed/: the repository's, not part of the installed package
SCRIPT = os.path.join("launch", "train_example.py")
# A plain DDP script that never imports elastic_rt (what a new user brings): rank 0 prints
# `step=N world_size=W restart=R`, R being TORCHELASTIC_RESTART_COUNT.
PLAIN_SCRIPT = os.path.join("tests", "chaos", "scripts", "plain_ddp_steps.py")
TAG_ENV = "ELASTIC_RT_BENCH_TAG"  # inherited by every process a launcher starts: finds orphans too

STEP_RE = re.compile(r"(?<![\w])step=(\d+) loss=\S+ world_size=(\d+)")
START_RE = re.compile(r"(?<![\w])start step=\d+ world_size=(\d+)")
REASON_RE = re.compile(r"restarting the worker group: (.+?)\s*$")
FAILED_RE = re.compile(r"\] failed \(exitcode: (-?\d+)\)")  # torch's agent has torn down a failed worker group
# The survivor's agent reacts: torch starts stopping a failed group, or elastic-rt restarts (e.g. peer lost).
DETECT_RE = re.compile(r"Sending process \d+ closing signal|\] failed \(exitcode|restarting the worker group|workers hung")
PLAIN_STEP_RE = re.compile(r"(?<![\w])step=(\d+) world_size=(\d+) restart=(\d+)")


def fmt(v: float | None, unit: str = "") -> str:
    """Seconds (or any figure) with two decimals for the tables; - for none."""
    return "-" if v is None else f"{v:.2f}{unit}"


class Deadline(Exception):
    """A poll ran past its deadline."""


class TrialFailed(Exception):
    """The trial could not be set up (no measurement); the message says why."""


@dataclass
class Event:
    t: float            # time.monotonic() when the line arrived
    src: str            # node name
    text: str | None    # None: the node's stdout closed (the launcher exited)


@dataclass
class TrialResult:
    outcome: str                     # recovered | timeout | crashed | error
    recovery_s: float | None = None  # kill -> first completed step after recovery
    restart_s: float | None = None   # kill -> the restarted job's "start step=0" line
    detect_s: float | None = None    # kill -> the survivor's agent first reacts (DETECT_RE)
    cold_start_s: float | None = None  # launcher start -> first step (the floor a restart cannot beat)
    group_failures: int = 0          # worker-group failures the survivor saw between kill and recovery
    reasons: list[str] = field(default_factory=list)  # elastic-rt's "restarting the worker group: REASON"
    detail: str = ""
    victim: str = ""
    rank0_node: str = ""
    extra: dict = field(default_factory=dict)  # scenario-specific figures (failure_scenarios.py)


@dataclass
class Scenario:
    key: str
    fault: str          # worker | node | etcd-outage | hang | partition
    launcher: str       # elastic-rt | torchrun
    rdzv: str           # short description of the rendezvous
    kill: str           # which process/node is killed
    results: list[TrialResult] = field(default_factory=list)

    def label(self, trial: int) -> str:
        """A name usable as a directory and as a --rdzv-id."""
        return f"{self.key.replace('/', '-')}-{trial}"


class Node:
    """One launcher process in its own session; its stdout+stderr read line by line into a queue."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], events: queue.Queue, log_dir: str):
        self.name, self.cmd = name, cmd
        self.tag = env[TAG_ENV]
        self.log_path = os.path.join(log_dir, f"{name}.log")
        self.tail: list[str] = []
        self.proc = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT, start_new_session=True, text=True, bufsize=1, errors="replace",
        )
        self._thread = threading.Thread(target=self._read, args=(events,), daemon=True)
        self._thread.start()

    def _read(self, events: queue.Queue) -> None:
        with open(self.log_path, "w") as log:
            log.write("$ " + " ".join(self.cmd) + "\n")
            for raw in self.proc.stdout:
                t = time.monotonic()
                text = raw.rstrip("\n")
                log.write(f"{t:.3f} {text}\n")
                self.tail = (self.tail + [text])[-30:]
                events.put(Event(t, self.name, text))
        events.put(Event(time.monotonic(), self.name, None))

    def workers(self, script: str = SCRIPT) -> list[psutil.Process]:
        """The agent's direct children that run the training script."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        out = []
        for c in children:
            try:
                if any(a.endswith(os.path.basename(script)) for a in c.cmdline()):
                    out.append(c)
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        return out

    def kill(self) -> float:
        """SIGKILL the whole node: the agent's process group and every process carrying this node's
        tag (torch starts workers in sessions of their own, so killpg alone would miss them).
        Returns time.monotonic() taken just before the first signal."""
        pids = tagged_pids(self.tag)
        t = time.monotonic()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return t

    def close(self) -> None:
        self.kill()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self._thread.join(timeout=5)


def tagged_pids(prefix: str) -> list[int]:
    """Pids of this user's processes whose TAG_ENV starts with prefix."""
    me, out = os.getuid(), []
    for p in psutil.process_iter(["pid", "uids"]):
        try:
            if p.info["uids"] is None or p.info["uids"].real != me or p.pid == os.getpid():
                continue
            if p.environ().get(TAG_ENV, "").startswith(prefix):
                out.append(p.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


def kill_tagged(prefix: str) -> None:
    procs = []
    for pid in tagged_pids(prefix):
        try:
            p = psutil.Process(pid)
            p.kill()
            procs.append(p)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


class Trial:
    """Starts launcher nodes for one trial and kills all of them (and their orphans) on exit."""

    def __init__(self, bench: "Bench", label: str):
        self.bench = bench
        self.tag = f"{bench.run_tag}/{label}/"
        self.log_dir = os.path.join(bench.scratch, label)
        os.makedirs(self.log_dir, exist_ok=True)
        self.events: queue.Queue[Event] = queue.Queue()
        self.nodes: dict[str, Node] = {}

    def start(self, name: str, cmd: list[str], env: dict[str, str] | None = None) -> Node:
        tmp = os.path.join(self.log_dir, f"tmp-{name}")
        os.makedirs(tmp, exist_ok=True)
        env = dict(os.environ, TMPDIR=tmp, PYTHONUNBUFFERED="1", **(env or {}), **{TAG_ENV: self.tag + name})
        env.pop("ELASTIC_RT_CHECKPOINT_URL", None)  # measured without checkpoints: restarts begin at step 0
        if self.bench.args.omp_threads > 0:
            env["OMP_NUM_THREADS"] = str(self.bench.args.omp_threads)
        node = self.nodes[name] = Node(name, cmd, env, self.events, self.log_dir)
        self.bench.log(f"  [{name}] $ {' '.join(cmd)}")
        return node

    def next(self, deadline: float) -> Event:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise Deadline()
        try:
            ev = self.events.get(timeout=remaining)
        except queue.Empty:
            raise Deadline() from None
        if self.bench.args.verbose and ev.text is not None:
            print(f"    {ev.src}| {ev.text}", file=sys.stderr)
        return ev

    def tails(self) -> str:
        return "\n".join(f"--- {n.name} (last lines; log {n.log_path})\n" + "\n".join(n.tail[-12:])
                         for n in self.nodes.values())

    def __enter__(self) -> "Trial":
        return self

    def __exit__(self, *exc) -> None:
        for node in self.nodes.values():
            node.close()
        kill_tagged(self.tag)


class Bench:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.run_tag = f"recovery-{uuid.uuid4().hex[:8]}"
        self.scratch = tempfile.mkdtemp(prefix="elastic-rt-bench-", dir=args.scratch_dir)
        self.etcd = None
        bindir = os.path.dirname(sys.executable)
        self.ert = self._exe(bindir, "elastic-rt", ["-m", "elastic_rt.cli"])
        self.torchrun = self._exe(bindir, "torchrun", ["-m", "torch.distributed.run"])

    @staticmethod
    def _exe(bindir: str, name: str, module: list[str]) -> list[str]:
        path = os.path.join(bindir, name)
        return [path] if os.access(path, os.X_OK) else [sys.executable, *module]

    def log(self, msg: str) -> None:
        if self.args.verbose:
            print(msg, file=sys.stderr, flush=True)

    def etcd_endpoint(self) -> str:
        if self.etcd is None:
            from etcd_testbed.server import EtcdCluster

            self.etcd = EtcdCluster(1).start()
        return self.etcd.endpoints

    def job_args(self, plain: bool = False) -> list[str]:
        a = self.args
        if plain:
            return [PLAIN_SCRIPT, "--steps", str(a.steps), "--step-sleep", str(a.step_sleep)]
        return [SCRIPT, "--steps", str(a.steps), "--batch-size", str(a.batch_size), "--step-sleep", str(a.step_sleep)]

    def close(self) -> None:
        kill_tagged(self.run_tag)
        if self.etcd is not None:
            self.etcd.stop()
        if self.args.keep_logs:
            print(f"logs kept in {self.scratch}", file=sys.stderr)
        else:
            shutil.rmtree(self.scratch, ignore_errors=True)

    # ---- commands ------------------------------------------------------------------------------
    def worker_cmd(self, sc: Scenario, rdzv_id: str, extra: tuple[str, ...] = ()) -> list[str]:
        plain = sc.fault != "worker"
        if sc.launcher == "torchrun":
            return [*self.torchrun, "--standalone", "--nproc-per-node", "2", "--max-restarts", "3",
                    "--tee", "3", *self.job_args(plain)]
        if sc.rdzv.startswith("standalone"):
            return [*self.ert, "launch", "--standalone", "--nproc-per-node", "2", "--metrics-port", "0",
                    "--tee", "3", *extra, *self.job_args(plain)]
        return [*self.ert, "launch", "--nnodes", "1", "--nproc-per-node", "2", "--rdzv-endpoint",
                self.etcd_endpoint(), "--rdzv-id", rdzv_id, "--local-addr", "127.0.0.1", "--node-id", "node0",
                "--metrics-port", "0", "--tee", "3", *extra, *self.job_args(plain)]

    def node_cmd(self, sc: Scenario, rdzv_id: str, node: str, port: int, *, endpoint: str | None = None,
                 local_addr: str = "127.0.0.1", nnodes: str = "1:2", nproc: int = 1,
                 extra: tuple[str, ...] = ()) -> list[str]:
        """One node's launcher command; the failure-model scenarios run the plain script."""
        job = [*extra, *self.job_args(plain=sc.fault != "node")]
        if sc.launcher == "torchrun":
            return [*self.torchrun, "--nnodes", nnodes, "--nproc-per-node", str(nproc), "--rdzv-backend", "c10d",
                    "--rdzv-endpoint", endpoint or f"127.0.0.1:{port}", "--rdzv-id", rdzv_id,
                    "--local-addr", local_addr, "--max-restarts", "3", "--tee", "3", *job]
        # torch's handler without a job secret, as the committed figures measured it (the secret's HMAC is not
        # what these scenarios time); elastic-rt refuses that unless it is said
        backend = (["--rdzv-backend", "etcd-v3-torch", "--rdzv-conf", "insecure_state=1"]
                   if sc.rdzv == "etcd-v3-torch" else [])
        return [*self.ert, "launch", "--nnodes", nnodes, "--nproc-per-node", str(nproc), *backend,
                "--rdzv-endpoint", endpoint or self.etcd_endpoint(), "--rdzv-id", rdzv_id, "--local-addr",
                local_addr, "--node-id", node, "--metrics-port", "0", "--tee", "3", *job]

    # ---- shared steps of a trial ----------------------------------------------------------------
    def warm_up(self, tr: Trial, node: Node, t_start: float, step_re: re.Pattern = STEP_RE) -> float | None:
        """Wait until the one-node job has logged --warmup-steps steps; returns the cold start (s)."""
        a, cold = self.args, None
        deadline = t_start + a.startup_timeout
        try:
            while True:
                ev = tr.next(deadline)
                if ev.text is None:
                    raise TrialFailed(f"launcher exited (rc={node.proc.wait()}) before step {a.warmup_steps}")
                m = step_re.search(ev.text)
                if m:
                    cold = cold or ev.t - t_start
                if m and int(m[1]) >= a.warmup_steps:
                    return cold
        except Deadline:
            raise TrialFailed(f"no step {a.warmup_steps} within {a.startup_timeout:g} s of start") from None

    def find_worker(self, node: Node, local_rank: int, deadline: float, script: str = SCRIPT) -> psutil.Process:
        """The node's worker with LOCAL_RANK=local_rank (polled: both are up by now)."""
        while True:
            for w in node.workers(script):
                try:
                    if w.environ().get("LOCAL_RANK") == str(local_rank):
                        return w
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    pass
            if time.monotonic() > deadline:
                raise TrialFailed(f"no worker with LOCAL_RANK={local_rank} within {self.args.startup_timeout:g} s")
            time.sleep(0.05)

    def start_pair(self, tr: Trial, cmds: dict[str, list[str]], t_start: float, *, store: tuple[str, int] | None,
                   world: str, step_re: re.Pattern = STEP_RE, env: dict[str, dict] | None = None
                   ) -> tuple[str, float | None]:
        """Start nodeA then nodeB (for torchrun, nodeB once nodeA's c10d store listens at `store`) and wait
        until both train at `world` and --warmup-steps steps are logged. Returns (the node printing the
        steps, i.e. holding rank 0; the cold start)."""
        a, env = self.args, env or {}
        deadline, cold = t_start + a.startup_timeout, None
        tr.start("nodeA", cmds["nodeA"], env.get("nodeA"))
        while store is not None and not any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == store[1]
                                            for c in psutil.net_connections("tcp")):
            if tr.nodes["nodeA"].proc.poll() is not None or time.monotonic() > deadline:
                raise TrialFailed(f"nodeA never listened on the c10d store port {store[1]}")
            time.sleep(0.05)
        tr.start("nodeB", cmds["nodeB"], env.get("nodeB"))
        rank0, started = None, set()
        try:
            while rank0 is None:  # the nodes train together: steps at world size `world`
                ev = tr.next(deadline)
                if ev.text is None:
                    raise TrialFailed(f"{ev.src} exited (rc={tr.nodes[ev.src].proc.wait()}) before training")
                m = START_RE.search(ev.text)
                if m and m[1] == world:
                    started.add(ev.src)
                m = step_re.search(ev.text)
                if m and m[2] == world and (ev.src in started or step_re is not STEP_RE):
                    cold = cold or ev.t - t_start
                    if int(m[1]) >= a.warmup_steps:
                        rank0 = ev.src
        except Deadline:
            raise TrialFailed(f"no step {a.warmup_steps} at world size {world} within {a.startup_timeout:g} s") from None
        return rank0, cold

    # ---- (a) a worker is SIGKILLed ---------------------------------------------------------------
    def worker_trial(self, sc: Scenario, i: int) -> TrialResult:
        a = self.args
        with Trial(self, sc.label(i)) as tr:
            t_start = time.monotonic()
            node = tr.start("node0", self.worker_cmd(sc, f"{self.run_tag}-{sc.label(i)}"))
            cold = self.warm_up(tr, node, t_start)
            victim = self.find_worker(node, a.kill_local_rank, t_start + a.startup_timeout)
            t_kill = time.monotonic()
            victim.kill()
            res = TrialResult("timeout", victim=f"local rank {a.kill_local_rank} (pid {victim.pid})",
                              cold_start_s=cold)
            return self._await_recovery(tr, res, t_kill, a.worker_timeout, survivor="node0", world=None)

    # ---- (b) a whole node is SIGKILLed ----------------------------------------------------------
    def node_trial(self, sc: Scenario, i: int) -> TrialResult:
        a = self.args
        from etcd_testbed.server import free_port

        port = free_port() if sc.launcher == "torchrun" else 0
        rdzv_id = f"{self.run_tag}-{sc.label(i)}"
        with Trial(self, sc.label(i)) as tr:
            cmds = {n: self.node_cmd(sc, rdzv_id, n, port) for n in ("nodeA", "nodeB")}
            store = ("127.0.0.1", port) if sc.launcher == "torchrun" else None  # nodeA must be the store host
            rank0, cold = self.start_pair(tr, cmds, time.monotonic(), store=store, world="2")
            other = "nodeB" if rank0 == "nodeA" else "nodeA"
            victim = {"rank0": rank0, "non-rank0": other, "store-host": "nodeA", "non-host": "nodeB"}[sc.kill]
            survivor = "nodeB" if victim == "nodeA" else "nodeA"
            t_kill = tr.nodes[victim].kill()
            res = TrialResult("timeout", victim=victim, rank0_node=rank0, cold_start_s=cold)
            return self._await_recovery(tr, res, t_kill, a.node_timeout, survivor=survivor, world="1")

    def _await_recovery(self, tr: Trial, res: TrialResult, t_kill: float, limit_s: float, *,
                        survivor: str, world: str | None, step_re: re.Pattern = STEP_RE,
                        restarted_by=None) -> TrialResult:
        """Poll the survivor's output until it completes a step after recovering: at world size `world`,
        or (world None) after the restarted job's 'start' line, or the first line `restarted_by(text)`
        accepts (scripts without a start line)."""
        deadline, restarted, last = t_kill + limit_s, False, None
        try:
            while True:
                ev = tr.next(deadline)
                if ev.src != survivor:
                    continue
                last = ev.t
                if ev.text is None:
                    rc = tr.nodes[survivor].proc.wait()
                    res.outcome = "crashed"
                    res.detail = f"survivor's launcher exited rc={rc} {ev.t - t_kill:.1f} s after the kill"
                    break
                m = REASON_RE.search(ev.text)
                if m:
                    res.reasons.append(m[1])
                if FAILED_RE.search(ev.text):
                    res.group_failures += 1
                if DETECT_RE.search(ev.text):
                    res.detect_s = res.detect_s or ev.t - t_kill
                m = START_RE.search(ev.text) if restarted_by is None else None
                if (m and (world is None or m[1] == world)) or (restarted_by is not None and restarted_by(ev.text)):
                    restarted = True
                    res.restart_s = res.restart_s or ev.t - t_kill
                m = step_re.search(ev.text)
                if m and restarted and (world is None or m[2] == world):
                    res.outcome, res.recovery_s = "recovered", ev.t - t_kill
                    break
        except Deadline:
            silent = f", silent since {last - t_kill:.1f} s after the kill" if last and last > t_kill else ""
            res.detail = f"no recovery within {limit_s:g} s{silent}"
        if res.outcome != "recovered" and self.args.verbose:
            print(tr.tails(), file=sys.stderr)
        return res
