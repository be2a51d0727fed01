"""The frozen configuration of one node's agent (what `elastic-rt launch` was asked to do)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeVar

from elastic_rt import sections as _sections

S = TypeVar("S")

# Suggested default for --metrics-port. Inside the 9100-9999 range Prometheus uses
# for exporters (so "exporter ports" firewall rules and scrape configs cover it),
# and clear of what usually runs on a GPU node: node_exporter 9100, DCGM exporter
# 9400, OpenTelemetry's Prometheus exporter 9464.
DEFAULT_METRICS_PORT = 9402
# Every IPv4 interface: Prometheus and the kubelet's probes reach a pod at its pod IP, and a
# bare-metal scraper at the node's address. 127.0.0.1 keeps the endpoints on the node; "::"
# serves IPv6 and IPv4.
DEFAULT_METRICS_HOST = "0.0.0.0"


@dataclass(frozen=True, kw_only=True)
class AgentConfig:
    """Everything one node's agent needs, validated (built by elastic_rt.launch_config from the flags)."""

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
    checkpoint_url: str | None = None
    sysfs_root: str = "/sys"
    # exported into the agent's environment at launch, so every worker inherits them (torchrun's contract)
    worker_env: tuple[tuple[str, str], ...] = ()
    omp_threads_defaulted: bool = False  # OMP_NUM_THREADS=1 was chosen for the user: warn once
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
    # each feature's own settings, as its flags set them (elastic_rt/sections.py; the list: config.SECTIONS)
    sections: tuple[object, ...] = ()

    def section(self, kind: type[S]) -> S:
        """The feature's config section (StragglerSettings, WarmSettings, ...): as the flags set it, or its
        defaults."""
        return _sections.pick(self.sections, kind)

    @property
    def conf(self) -> dict[str, str]:
        return dict(self.rdzv_conf)
