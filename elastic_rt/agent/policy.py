"""Restart policy: whether a group whose workers all run must restart anyway (a hang, a failed probe)."""

from __future__ import annotations

import logging
from typing import Callable, Iterable, Mapping

from elastic_rt.diagnostics.hang import HangDetector, HangTimeout, HangVerdict
from elastic_rt.decisions import DetectionAction, RestartReason
from elastic_rt.interfaces import RestartPolicy
from elastic_rt.worker_reports.heartbeat import Heartbeat

log = logging.getLogger(__name__)


class HealthPolicy(RestartPolicy):
    """Hang: no step progress for hang_timeout_s (None = auto, see hang.HangTimeout; 0 = never).
    Probe: with action LEAVE, a failed collective probe of the current round makes this node
    leave so the others re-form without it."""

    def __init__(self, *, heartbeats: Callable[[], Mapping[int, Heartbeat | None]],
                 probe_failure: Callable[[], str | None] = lambda: None, hang_timeout_s: float | None = 0.0,
                 probe_failure_action: DetectionAction | str = DetectionAction.REPORT,
                 clock: Callable[[], float] | None = None) -> None:
        self._heartbeats = heartbeats
        self._probe_failure = probe_failure
        self._leave_on_probe_failure = DetectionAction(probe_failure_action) is DetectionAction.LEAVE
        self._hang: HangDetector | None = None
        if hang_timeout_s is None or hang_timeout_s > 0:
            timeout = HangTimeout(fixed_s=hang_timeout_s)
            self._hang = HangDetector(timeout=timeout, **({"clock": clock} if clock else {}))
        self.last_hang: HangVerdict | None = None

    def describe_hang_timeout(self) -> str:
        return self._hang.timeout.describe() if self._hang is not None else "hang detection off"

    def hang_verdict(self) -> HangVerdict | None:
        return self.last_hang

    def on_hang_restart(self) -> None:
        """The agent restarts for a hang: with the auto timeout, the next floor is longer (no crash loop)."""
        if self._hang is not None:
            self._hang.timeout.on_hang_restart()

    def on_workers_started(self, local_ranks: Iterable[int]) -> None:
        if self._hang is not None:
            self._hang.start(local_ranks)

    def check(self) -> RestartReason | None:
        if self._leave_on_probe_failure and self._probe_failure() is not None:
            return RestartReason.PROBE_FAILURE
        if self._hang is None:
            return None
        self._hang.observe_all(self._heartbeats())
        verdict = self._hang.check()
        if verdict.hung:
            self.last_hang = verdict
            return RestartReason.HANG
        return None
