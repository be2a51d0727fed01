"""FailureDiagnostics: one line and one count per failure of its own, the hang line, stacks on grace expiry."""

from __future__ import annotations

import logging
import subprocess
import sys
import time
from types import SimpleNamespace

import psutil
from prometheus_client import CollectorRegistry

from elastic_rt.diagnostics.failure_diagnostics import FailureDiagnostics
from elastic_rt.diagnostics.hang import HangVerdict, RankStall
from elastic_rt.worker.main import record_error
from elastic_rt.diagnostics.failure_metrics import FailureMetrics

BASE = {"run_id": "r", "node": "n"}


def make(tmp_path):
    reg = CollectorRegistry()
    diag = FailureDiagnostics(log_dir=str(tmp_path), reports_dir=str(tmp_path / "hb"),
                              metrics=FailureMetrics(registry=reg, run_id="r", node="n"))
    return diag, reg


def test_siblings_that_torch_terminated_are_not_failures_of_their_own(tmp_path, caplog):
    diag, reg = make(tmp_path)
    diag.on_workers_started([(0, 4, 1000), (1, 5, 1001)], {})
    pcontext = SimpleNamespace(_running_local_ranks={1}, closed=[])
    pcontext.close = lambda *a, **k: pcontext.closed.append(a)
    diag.watch(pcontext)
    pcontext.close()  # torch's _poll: rank 0 failed, terminate the rest
    error_file = str(tmp_path / "error.json")
    try:
        raise ValueError("bad batch")
    except ValueError as exc:
        record_error(exc, error_file)
    failures = {4: SimpleNamespace(local_rank=0, pid=1000, exitcode=1, error_file=error_file),
                5: SimpleNamespace(local_rank=1, pid=1001, exitcode=-15, error_file="<N/A>")}
    with caplog.at_level(logging.INFO, logger="elastic_rt.diagnostics.failure_diagnostics"):
        causes = diag.on_failures("[n round 2]", failures)
    assert [c.cause for c in causes] == ["exception"]
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("[n round 2] worker failed: rank 4 (local 0, pid 1000) cause=exception: "
                               "ValueError: bad batch at test_diagnostics.py:")
    assert lines[1] == "[n round 2] worker stopped: rank 5 (local 1, pid 1001) by the agent (SIGTERM) after rank(s) [4] failed"
    assert reg.get_sample_value("elastic_rt_worker_failures_total", {**BASE, "cause": "exception"}) == 1
    assert reg.get_sample_value("elastic_rt_worker_failures_total", {**BASE, "cause": "killed"}) == 0


def test_a_stopped_sibling_that_had_recorded_an_exception_is_the_root_cause(tmp_path, caplog):
    """Rank 5 raised and was still tearing down when rank 4, broken by its death, aborted first and the
    agent SIGTERMed rank 5: its recorded exception makes it a failure of its own, named as such."""
    diag, reg = make(tmp_path)
    diag.on_workers_started([(0, 4, 1000), (1, 5, 1001)], {})
    pcontext = SimpleNamespace(_running_local_ranks={1}, closed=[])
    pcontext.close = lambda *a, **k: pcontext.closed.append(a)
    diag.watch(pcontext)
    pcontext.close()
    error_file = str(tmp_path / "error.json")
    try:
        raise ValueError("injected failure")
    except ValueError as exc:
        record_error(exc, error_file)
    failures = {4: SimpleNamespace(local_rank=0, pid=1000, exitcode=-6, error_file="<N/A>"),
                5: SimpleNamespace(local_rank=1, pid=1001, exitcode=-15, error_file=error_file)}
    with caplog.at_level(logging.INFO, logger="elastic_rt.diagnostics.failure_diagnostics"):
        causes = diag.on_failures("[n]", failures)
    assert [c.cause for c in causes] == ["signal", "exception"]
    assert not any("worker stopped" in r.getMessage() for r in caplog.records)
    assert reg.get_sample_value("elastic_rt_worker_failures_total", {**BASE, "cause": "exception"}) == 1


def test_all_sigtermed_from_outside_are_killed(tmp_path):
    diag, reg = make(tmp_path)
    diag.on_workers_started([(0, 0, 1000)], {})
    causes = diag.on_failures("[n]", {0: SimpleNamespace(local_rank=0, pid=1000, exitcode=-15, error_file="<N/A>")})
    assert [c.cause for c in causes] == ["killed"]


def test_hang_line_names_the_first_rank_and_writes_its_stacks(tmp_path, caplog):
    diag, reg = make(tmp_path)
    proc = subprocess.Popen([sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(600)"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        deadline = time.monotonic() + 30
        while psutil.Process(proc.pid).status() != "sleeping" and time.monotonic() < deadline:
            time.sleep(0.01)
        diag.on_workers_started([(0, 5, proc.pid)], {})
        verdict = HangVerdict(hung=True, stuck=(0,), stalled_s=301.0, reason="local rank(s) [0] made no step progress",
                              stalls=(RankStall(local_rank=0, pid=proc.pid, last_step=9, last_progress_s=1.0,
                                                stalled_s=301.0),), timeout_s=300.0)
        with caplog.at_level(logging.INFO, logger="elastic_rt.diagnostics.failure_diagnostics"):
            out_dir = diag.on_hang("[n round 1]", verdict)
        state = "sleeping"
        line = caplog.records[-1].getMessage()
        assert line.startswith(f"[n round 1] workers hung: rank 5 (local 0, pid {proc.pid}, state {state}) stopped "
                               f"progressing first (last step 9); local rank(s) [0] made no step progress; cause=hang; "
                               f"stacks of every local rank in {out_dir}")
        text = (tmp_path / "stacks" / out_dir.rsplit("/", 1)[-1] / f"rank5-local0-pid{proc.pid}.txt").read_text()
        assert "stack dumps are off" in text and "last step 9, no progress for 301.0 s" in text
        assert reg.get_sample_value("elastic_rt_hangs_total",
                                    {**BASE, "local_rank": "0", "process_state": state}) == 1
        # the same workers outliving SIGTERM right after: already dumped, nothing written twice
        assert diag.on_grace_expired("[n round 1]", [proc.pid], 1.0) is None
        diag.on_workers_started([(0, 5, proc.pid)], {})
        assert diag.on_grace_expired("[n round 2]", [proc.pid], 1.0).endswith("-sigterm-grace-expired")
    finally:
        proc.kill()
        proc.wait()
