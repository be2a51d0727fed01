"""The composition root of `elastic-rt launch`: an AgentConfig wired into a rendezvous handler, a WorkerSpec, the
agent and its features (each from its config section); run; the outcome mapped to an exit code."""

from __future__ import annotations

import logging
import os
import shutil
import socket
import sys
import tempfile
import threading

from torch.distributed.elastic import events
from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import Std
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousConnectionError,
    RendezvousError,
    RendezvousParameters,
    RendezvousTimeoutError,
)
from torch.distributed.elastic.rendezvous.registry import get_rendezvous_handler

from elastic_rt.agent import stop_signal
from elastic_rt.agent.agent import ElasticRTAgent
from elastic_rt.agent.crash_loop import CrashLoopError, CrashLoopJudge, CrashLoopSettings
from elastic_rt.diagnostics.failure_diagnostics import DiagnosticsSettings, build_diagnostics
from elastic_rt.agent.fanout import ObserverGroup, PolicyGroup
from elastic_rt.agent.limits import needed_open_files, raise_open_files_limit
from elastic_rt.worker.numa import check_binding, cpu_list, numa_options
from elastic_rt.agent.policy import HealthPolicy
from elastic_rt.agent.config import AgentConfig
from elastic_rt.agent.host_memory import HostCacheRoom, HostMemorySettings, make_host_cache
from elastic_rt.agent.replica_server import replica_budget_bytes, start_memory_tier
from elastic_rt.checkpoint.host_cache import reserve_bytes
from elastic_rt.agent.warm import WarmSettings, make_warm_pool
from elastic_rt.collectors.schedule import CollectorSettings, NtpPoller, RoundChecks
from elastic_rt.doctor.command import refuse_an_unfit_node
from elastic_rt.doctor.preflight import PreflightSettings, build_node_test
from elastic_rt.errors import (ConfigError, ElasticRTError, EtcdUnavailableError,
                               NodeExcludedError, RunClosedError)
from elastic_rt.interfaces import MembershipHandler
from elastic_rt.metrics.health_endpoints import liveness_threshold_s
from elastic_rt.metrics.readiness import add_readiness_checks
from elastic_rt.metrics.metrics_observer import MetricsObserver
from elastic_rt.goodput.goodput_observer import GoodputObserver, StragglerPolicy, process_start_monotonic
from elastic_rt.goodput.stragglers import StragglerSettings
from elastic_rt.rendezvous import registration
from elastic_rt.rendezvous.claim import JobFingerprint
from elastic_rt.worker_reports.checkpoint import CheckpointReportReader
from elastic_rt.worker_reports.inbox import WorkerReports
from elastic_rt.torchrun_compat import STATIC_RDZV_TIMEOUT_S, logs_specs_class
from elastic_rt.worker_env import ENV_CHECKPOINT_URL, ENV_NO_COMPUTE_TIMER, OMP_DEFAULT_WARNING

log = logging.getLogger(__name__)


def _std(value: str, flag: str):
    try:
        return Std.from_str(value)
    except ValueError as exc:
        raise ConfigError(f"{flag} {value!r}: {exc}") from exc


def worker_command(cfg: AgentConfig) -> tuple[str, tuple[str, ...]]:
    """The entrypoint and arguments of each worker process."""
    if cfg.no_python:
        return cfg.script, cfg.script_args
    runner = ("-u", "-m", "elastic_rt.worker.main", "--")
    target = ("-m", cfg.script) if cfg.run_as_module else (cfg.script,)
    return sys.executable, runner + target + cfg.script_args


def apply_worker_env(cfg: AgentConfig) -> None:
    """Export the launch-time worker variables (torchrun's, then elastic-rt's) into this process's
    environment, which torch's agent copies into every worker it starts, restarts included."""
    if cfg.omp_threads_defaulted:
        log.warning(OMP_DEFAULT_WARNING)
    os.environ.update(cfg.worker_env)
    if not cfg.section(StragglerSettings).enabled:  # detection off: workers need not time their compute
        os.environ[ENV_NO_COMPUTE_TIMER] = "1"
    if cfg.checkpoint_url:
        os.environ[ENV_CHECKPOINT_URL] = cfg.checkpoint_url


def build_handler(cfg: AgentConfig):
    registration.register()
    params = RendezvousParameters(
        backend=cfg.rdzv_backend,
        endpoint=cfg.rdzv_endpoint,
        run_id=cfg.rdzv_id,
        min_nodes=cfg.min_nodes,
        max_nodes=cfg.max_nodes,
        local_addr=cfg.local_addr,
        **cfg.conf,
    )
    if cfg.rdzv_backend == "etcd-v3":  # the job's claim on the run (rendezvous/claim.py)
        params.config["fingerprint"] = JobFingerprint.of(
            script=cfg.script, script_args=cfg.script_args, min_nodes=cfg.min_nodes, max_nodes=cfg.max_nodes,
            launch_id=cfg.conf.get("launch_id", "")).encode()
    if cfg.metrics_port:  # the etcd-v3 handler advertises it in alive/ (`elastic-rt status` reads it)
        params.config[registration.METRICS_HOST_KEY] = cfg.metrics_host
        params.config[registration.METRICS_PORT_KEY] = str(cfg.metrics_port)
    if cfg.rdzv_backend == "c10d" and cfg.standalone:
        params.config.setdefault("is_host", "true")
    if cfg.rdzv_backend == "static":  # torchrun's: node rank 0 hosts the store at the endpoint
        params.config["rank"] = cfg.node_rank
        params.config.setdefault("timeout", STATIC_RDZV_TIMEOUT_S)
    if cfg.rdzv_backend != "etcd-v3":
        # torch's DynamicRendezvousHandler would have restarted workers reuse the agent's
        # TCPStore, where the keys of the failed attempt are still present: restarts then
        # fail to connect or hang. A fresh store hosted by rank 0 per attempt avoids that.
        os.environ.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    try:
        return get_rendezvous_handler(params)
    except ElasticRTError:
        raise
    except (ValueError, TypeError, RuntimeError) as exc:
        raise ConfigError(f"rendezvous configuration ({cfg.rdzv_backend}): {exc}") from exc


def launch(cfg: AgentConfig) -> int:
    """Run this node's agent until the job ends. Returns the process exit code."""
    if not cfg.no_python and not cfg.run_as_module and not os.path.isfile(cfg.script):
        raise ConfigError(f"training script {cfg.script!r} not found")
    bound = check_binding(cfg.numa_binding, cfg.nproc_per_node) if cfg.numa_binding else {}
    stop_signal.install()
    refuse_an_unfit_node(sysfs_root=cfg.sysfs_root)
    raise_open_files_limit(needed_open_files(max_nodes=cfg.max_nodes, nproc_per_node=cfg.nproc_per_node))
    apply_worker_env(cfg)
    handler = build_handler(cfg)
    extras = handler if isinstance(handler, MembershipHandler) else None  # the etcd-v3 handler's
    node_id = (extras.settings.node_id if extras else None) or cfg.node_id or f"node-{os.getpid()}"
    for note in cfg.notes:
        log.warning("[%s] %s", node_id, note)
    if bound:
        log.info("[%s] --numa-binding %s: %s", node_id, cfg.numa_binding,
                 "; ".join(f"local rank {r} on CPUs {cpu_list(c)}" for r, c in sorted(bound.items())))
    entrypoint, args = worker_command(cfg)
    spec = WorkerSpec(
        role=cfg.role,
        local_world_size=cfg.nproc_per_node,
        entrypoint=entrypoint,
        args=args,
        rdzv_handler=handler,
        max_restarts=cfg.max_restarts,
        monitor_interval=cfg.monitor_interval_s,
        local_addr=cfg.local_addr,
        event_log_handler=cfg.event_log_handler,
        numa_options=numa_options(cfg.numa_binding),
        duplicate_stdout_filters=list(cfg.duplicate_stdout_filters) or None,
        duplicate_stderr_filters=list(cfg.duplicate_stderr_filters) or None,
        virtual_local_rank=cfg.virtual_local_rank,
    )
    log_dir = cfg.log_dir or tempfile.mkdtemp(prefix=f"elastic-rt-{cfg.rdzv_id}-")
    logs_specs = logs_specs_class(cfg.logs_specs)(
        log_dir=log_dir, redirects=_std(cfg.redirects, "--redirects"), tee=_std(cfg.tee, "--tee"),
        local_ranks_filter=set(cfg.local_ranks_filter) or None,
    )
    reports = WorkerReports(os.path.join(log_dir, "heartbeat"))
    stop = threading.Event()
    collectors = cfg.section(CollectorSettings)
    metrics_observer = MetricsObserver(run_id=cfg.rdzv_id, node=node_id, reports=reports, sysfs_root=cfg.sysfs_root,
                                       liveness_threshold_s=liveness_threshold_s(cfg.monitor_interval_s))
    registry = metrics_observer.registry
    round_checks = RoundChecks(node=node_id, metrics=metrics_observer.metrics, stop=stop, settings=collectors)
    add_readiness_checks(metrics_observer.readiness, round_checks, sysfs_root=cfg.sysfs_root,
                         probe_enabled=collectors.probe_bytes > 0)
    metrics_observer.serve(cfg.metrics_host, cfg.metrics_port)
    NtpPoller(servers=collectors.ntp_servers, clock_metrics=metrics_observer.metrics.clock, stop=stop).start()
    goodput = GoodputObserver(run_id=cfg.rdzv_id, node=node_id, reports=reports, log_dir=log_dir,
                              settings=cfg.section(StragglerSettings), registry=registry,
                              started_at=process_start_monotonic())
    observer = ObserverGroup(metrics_observer, goodput)
    diagnostics = build_diagnostics(cfg.section(DiagnosticsSettings), log_dir=log_dir, reports_dir=reports.directory,
                                    registry=registry, run_id=cfg.rdzv_id, node=node_id)
    node_test = build_node_test(cfg.section(PreflightSettings), node=node_id, nproc=cfg.nproc_per_node,
                                min_nodes=cfg.min_nodes, backend=collectors.probe_backend, registry=registry,
                                run_id=cfg.rdzv_id)
    policy = HealthPolicy(
        heartbeats=reports.heartbeats, hang_timeout_s=cfg.section(DiagnosticsSettings).hang_timeout_s,
        probe_failure=round_checks.probe_failure, probe_failure_action=collectors.probe_failure_action,
    )
    log.info("[%s] %s; stack dumps %s; flight recorder %s; logs in %s", node_id, policy.describe_hang_timeout(),
             f"on signal {diagnostics.stack_signal}" if diagnostics.stack_signal else "off",
             "on" if diagnostics.flight_recorder else "off", log_dir)
    policy = PolicyGroup(policy, StragglerPolicy(goodput))
    host_cache = make_host_cache(cfg, node_id)  # before the warm workers: they inherit its variable
    replicas = None if host_cache is None else start_memory_tier(
        host_cache=host_cache, node=node_id, secret_file=cfg.conf.get("secret_file"),
        advertise_host=cfg.local_addr or socket.gethostname(),
        max_replica_bytes=cfg.section(HostMemorySettings).replica_bytes or replica_budget_bytes(), registry=registry)
    warm_pool = make_warm_pool(cfg.section(WarmSettings), node=node_id, entrypoint=entrypoint, args=args,
                               nproc=cfg.nproc_per_node, no_python=cfg.no_python,
                               virtual_local_rank=cfg.virtual_local_rank)
    agent = ElasticRTAgent(
        spec,
        logs_specs,
        node_id=node_id,
        reports=reports,
        restart_grace_s=cfg.restart_grace_s,
        shutdown_grace_s=cfg.grace_period_s,
        # a lost peer shows within its lease TTL (the handler's validated setting, not a second default)
        peer_loss_wait_s=(extras.settings.lease_ttl_s if extras else 3.0) + 1.0,
        observer=observer,
        policy=policy,
        round_listeners=(node_test.on_round, round_checks.on_round, goodput.exchange.on_round)
        + ((HostCacheRoom(host_cache, reserve_bytes=reserve_bytes(host_cache), node_id=node_id).on_round,)
           if host_cache is not None else ()),
        diagnostics=diagnostics,
        warm_pool=warm_pool,
        scale_up_wait_s=cfg.section(WarmSettings).scale_up_wait_s,
        crash_loop=CrashLoopJudge(cfg.section(CrashLoopSettings), checkpoints=CheckpointReportReader(reports.directory)),
    )
    try:
        node_test.run_compute()  # before the first round, and before warm workers compete for the CPU
        if warm_pool is not None:
            warm_pool.start()
            observer.track_warm_workers(lambda: len(warm_pool.idle_pids(ready_only=True)))
        return _run(agent, cfg, node_id, log_dir, handler, extras)
    finally:
        if warm_pool is not None:
            warm_pool.close()
        if replicas is not None:
            replicas.close()
        if host_cache is not None:
            shutil.rmtree(host_cache, ignore_errors=True)
        stop.set()
        diagnostics.close()
        observer.close()
        if extras is not None:
            extras.close()


def _leave_finished(extras: MembershipHandler | None) -> None:
    """Leave a run that is over; its last agent removes its keys (all but the short-lived `closed` marker)."""
    if extras is not None:
        extras.leave()
        extras.tidy()


def _run(agent, cfg: AgentConfig, node_id: str, log_dir: str, handler, extras: MembershipHandler | None) -> int:
    leave = extras.leave if extras else None
    try:
        result = _recorded_run(agent, cfg.event_log_handler)
    except SignalException as exc:
        log.warning("[%s] received %s: workers stopped, leaving the rendezvous", node_id, exc.sigval.name)
        if leave:
            leave()
        return 128 + int(exc.sigval)
    except RendezvousClosedError as exc:
        # The job finished. A node that trained in it exits 0 (a Kubernetes pod or a systemd unit must not
        # crash-loop on it), and so does a node of the same launch (same fingerprint and launch_id: a pod or a
        # Slurm job restarted after its job finished); one of a new launch did not train: exit 5, unless the
        # operator said accept_closed=1.
        same = extras is not None and (extras.membership is not None or extras.settings.accept_closed
                                       or extras.closed_by_this_launch())
        _leave_finished(extras)
        why = str(exc) or f"run {cfg.rdzv_id} is closed (the job finished)"
        if same:
            log.warning("[%s] %s; exiting", node_id, why)
            return 0
        raise RunClosedError(f"{why} before this node joined; it did not train. Use a new --rdzv-id to train "
                             "again (or --rdzv-conf accept_closed=1 where a node may come after its job finished)"
                             ) from exc
    except NodeExcludedError as exc:
        if leave:
            leave()
        log.error("[%s] %s; leaving the job", node_id, exc)
        return exc.exit_code
    except CrashLoopError as exc:  # the agent said why in its verdict line
        if leave:
            leave()
        return exc.exit_code
    except RendezvousTimeoutError as exc:
        if leave:
            leave()
        raise ElasticRTError(str(exc)) from exc
    except RendezvousConnectionError as exc:
        raise EtcdUnavailableError(str(exc) or f"cannot reach the rendezvous at {cfg.rdzv_endpoint}") from exc
    except RendezvousError as exc:
        if leave:
            leave()
        raise ElasticRTError(f"rendezvous failed: {exc}") from exc
    if result is None:  # torch's run() returns None after a graceful rendezvous exit
        return 0
    if result.is_failed():
        for rank, failure in sorted(result.failures.items()):
            log.error("[%s] worker rank %d failed with exit code %s (log: %s)", node_id, rank,
                      failure.exitcode, failure.error_file or log_dir)
        if leave:
            leave()
        return 1
    if leave:
        try:
            handler.set_closed()  # the job is done: late joiners exit instead of waiting
        except RendezvousConnectionError as exc:  # the workers succeeded: that is the job's result
            log.warning("[%s] the job finished, but the run could not be marked closed in etcd (%s); a node "
                        "that joins run %s later waits for a round that never comes", node_id, exc,
                        cfg.rdzv_id)
        _leave_finished(extras)
    log.info("[%s] job finished", node_id)
    return 0


def _recorded_run(agent, event_log_handler: str):
    """agent.run(), with the agent's own outcome recorded to --event-log-handler as torchrun records it (the
    null handler discards events: nothing is built for it)."""
    if event_log_handler == "null":
        return agent.run()
    try:
        result = agent.run()
    except BaseException:
        events.record(agent.get_event_failed(), event_log_handler)
        raise
    events.record(agent.get_event_succeeded(), event_log_handler)
    return result
