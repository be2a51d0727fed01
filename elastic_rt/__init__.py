"""elastic-rt: elastic, fault-tolerant launcher and runtime for multi-node PyTorch training."""

from __future__ import annotations

__version__ = "0.1.0"


def report_step(step: int) -> None:
    """Tell the agent this worker completed `step` (about a microsecond; a no-op outside elastic-rt)."""
    from elastic_rt.worker_reports.heartbeat import report_step as _report

    _report(step)


def report_checkpoint(*, step: int, save_duration_s: float, blocked_s: float) -> None:
    """Tell the agent a checkpoint was committed (exported as elastic_rt_checkpoint_* metrics)."""
    from elastic_rt.worker_reports.checkpoint import report_checkpoint as _report

    _report(step=step, save_duration_s=save_duration_s, blocked_s=blocked_s)
