"""The frozen configuration of one node's agent (what `elastic-rt launch` was asked to do)."""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_rt.decisions import DetectionAction

# Suggested default for --metrics-port. Inside the 9100-9999 range Prometheus uses
# for exporters (so "exporter ports" firewall rules and scrape configs cover it),
# and clear of what usually runs on a GPU node: node_exporter 9100, DCGM exporter
# 9400, OpenTelemetry's Prometheus exporter 9464.
DEFAULT_METRICS_PORT = 9402
# Every IPv4 interface: Prometheus and the kubelet's probes reach a pod at its pod IP, and a
# bare-metal scraper at the node's address. 127.0.0.1 keeps the endpoints on the node; "::"
# serves IPv6 and IPv4.
DEFAULT_METRICS_HOST = "0.0.0.0"
# What a warm worker imports before it knows its rank: torch's own modules (DDP imports torch._dynamo
# on first use: seconds) and elastic-rt's checkpointing; nothing of the user's.
DEFAULT_WARM_IMPORTS = ("torch", "torch._dynamo", "torch.distributed.checkpoint", "elastic_rt.checkpoint")


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything one node's agent needs, validated (built by elastic_rt.config from the flags)."""

    min_nodes: int
    max_nodes: int
    nproc_per_node: int
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str
    rdzv_conf: tuple[tuple[str, str], ...] = ()
    node_rank: int = 0  # --rdzv-backend static only
    standalone: bool = False
    max_restarts: int = 3
    monitor_interval_s: float = 0.1
    local_addr: str | None = None
    node_id: str | None = None
    log_dir: str | None = None
    tee: str = "0"
    redirects: str = "0"
    grace_period_s: float = 30.0
    restart_grace_s: float = 1.0
    metrics_port: int = DEFAULT_METRICS_PORT
    metrics_host: str = DEFAULT_METRICS_HOST
    hang_timeout_s: float | None = None  # None: auto (docs/failures.md); 0: off
    stack_signal: int | None = None  # workers dump their Python stacks on it; None: off
    flight_recorder: str = "auto"  # torch's collective flight recorder in workers: auto (CUDA), on, off
    ntp_servers: tuple[str, ...] = ()
    checkpoint_url: str | None = None
    sysfs_root: str = "/sys"
    probe_bytes: int = 4 << 20
    probe_timeout_s: float = 30.0
    probe_backend: str = "auto"
    probe_interval_s: float = 0.0
    probe_failure_action: DetectionAction = DetectionAction.REPORT
    # exported into the agent's environment at launch, so every worker inherits them (torchrun's contract)
    worker_env: tuple[tuple[str, str], ...] = ()
    omp_threads_defaulted: bool = False  # OMP_NUM_THREADS=1 was chosen for the user: warn once
    straggler_threshold: float = 1.5
    straggler_windows: int = 3
    straggler_window_s: float = 10.0
    straggler_action: DetectionAction = DetectionAction.REPORT
    preflight: str = "auto"  # auto (report with CUDA, else off), off, report, exclude (doctor/preflight.py)
    preflight_threshold: float = 1.5
    preflight_timeout_s: float = 60.0
    preflight_every_round: bool = False
    crash_loop_repeats: int = 3  # agent/crash_loop.py; 0: off
    crash_loop_no_step: int = 5
    warm_workers: bool = True
    host_cache: bool = True
    memory_tier_replica_bytes: int | None = None  # None: a quarter of /dev/shm (agent/replica_server.py)
    warm_imports: tuple[str, ...] = DEFAULT_WARM_IMPORTS
    run_as_module: bool = False
    no_python: bool = False
    script: str = ""
    script_args: tuple[str, ...] = field(default_factory=tuple)
    # torchrun's flags, with torchrun's meaning (elastic_rt/torchrun_compat.py)
    role: str = "default"
    event_log_handler: str = "null"
    logs_specs: str | None = None  # a torchrun.logs_specs entry point; None: torch's DefaultLogsSpecs
    local_ranks_filter: tuple[int, ...] = ()  # () shows every local rank on the console
    duplicate_stdout_filters: tuple[str, ...] = ()
    duplicate_stderr_filters: tuple[str, ...] = ()
    numa_binding: str | None = None  # torch's AffinityMode value
    virtual_local_rank: bool = False
    notes: tuple[str, ...] = ()  # one line each, logged at start: flags whose meaning differs here

    @property
    def conf(self) -> dict[str, str]:
        return dict(self.rdzv_conf)
