"""`elastic-rt launch` of a run that already finished: a new launch exits 5 with one line and trains nothing; a node
of the launch that finished it (same fingerprint and launch_id: a restarted pod) and `accept_closed=1` exit 0."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.rendezvous.claim import JobFingerprint
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.chaos.harness import ROOT

SCRIPT = "tests/chaos/scripts/plain_ddp_steps.py"


def _close_as(endpoint: str, run_id: str, launch_id: str) -> None:
    """The run as its own job leaves it: formed, closed (with its fingerprint), left."""
    fp = JobFingerprint.of(script=SCRIPT, script_args=("--steps", "1"), min_nodes=1, max_nodes=1,
                           launch_id=launch_id).encode()
    h = create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, 1, 1, local_addr="127.0.0.1",
                                                    node_id="done", fingerprint=fp, launch_id=launch_id))
    try:
        h.next_rendezvous()
        h.set_closed()
    finally:
        h.leave()
        h.close()


def _launch(endpoint: str, run_id: str, conf: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "elastic_rt.cli", "launch", "--nnodes", "1", "--nproc-per-node", "1",
           "--rdzv-endpoint", endpoint, "--rdzv-id", run_id, "--local-addr", "127.0.0.1", "--metrics-port", "0",
           "--warm-workers", "off", *(["--rdzv-conf", conf] if conf else []), SCRIPT, "--steps", "1"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=str(ROOT)))


@pytest.mark.parametrize("conf, code", [
    ("launch_id=job-2", 5),  # another launch of the same command
    pytest.param("launch_id=job-1", 0, marks=pytest.mark.slow),  # the launch that finished it, restarted
    pytest.param("launch_id=job-2,accept_closed=1", 0, marks=pytest.mark.slow),
])
def test_joining_a_finished_run(etcd_endpoint, run_id, conf, code):
    _close_as(etcd_endpoint, run_id, "job-1")
    res = _launch(etcd_endpoint, run_id, conf)
    out = res.stdout + res.stderr
    assert res.returncode == code, out[-3000:]
    assert "done steps" not in out and "step=" not in out  # nothing trained
    if code == 5:
        (line,) = [ln for ln in res.stderr.splitlines() if "error" in ln.lower()]
        assert line.startswith("elastic-rt launch: error: run ") and "it did not train" in line, line
        assert "accept_closed=1" in line and "Traceback" not in out
