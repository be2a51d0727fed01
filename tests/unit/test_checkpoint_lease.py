"""One writer per URL: the writer lease refuses a second job, names the holder, hands over on release, and lets
the next writer of the same job (or the successor of a crashed one on this host) in at once."""

from __future__ import annotations

import os
import socket
import subprocess
import time

import pytest
import torch

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.backends import open_storage
from elastic_rt.checkpoint.fence import FencedError
from elastic_rt.checkpoint.manifest import WriterToken
from elastic_rt.checkpoint.writer_lease import LEASE_DIR, LeaseRecord, WriterLease
from elastic_rt.errors import CheckpointError
from elastic_rt.worker_env import ENV_RUN_ID


def test_a_second_job_on_the_same_url_refuses_with_one_line_naming_the_holder(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/ckpt"
    monkeypatch.setenv(ENV_RUN_ID, "job-a")
    with CheckpointManager(url) as first:
        first.save(1, {"w": torch.ones(4)})
        monkeypatch.setenv(ENV_RUN_ID, "job-b")
        with pytest.raises(CheckpointError) as exc_info:
            CheckpointManager(url, writer_wait_s=0)
        text = str(exc_info.value)
        assert "\n" not in text and "run job-a" in text and "one job per URL" in text
        assert first.save(2, {"w": torch.ones(4)}) is True  # the holder is untouched


def test_a_released_lease_is_taken_at_once_with_a_newer_epoch(tmp_path, monkeypatch):
    url = f"file://{tmp_path}/ckpt"
    monkeypatch.setenv(ENV_RUN_ID, "job-a")
    with CheckpointManager(url) as first:
        first.save(1, {"w": torch.ones(4)})
        epoch = first._guard.epoch
    monkeypatch.setenv(ENV_RUN_ID, "job-b")
    with CheckpointManager(url) as second:
        assert second._guard.epoch == epoch + 1
        assert second.save(2, {"w": torch.ones(4)}) is True


def test_the_environment_can_make_a_new_writer_wait(tmp_path, monkeypatch):
    monkeypatch.setenv("ELASTIC_RT_CHECKPOINT_WRITER_WAIT_S", "7.5")
    with CheckpointManager(f"file://{tmp_path}") as mgr:
        assert mgr.options.writer_wait_s == 7.5


def _lease(url: str, *, run_id: str, launch_id: str, round: int = 0, fenced: bool = False) -> WriterLease:
    token = WriterToken(run_id=run_id, launch_id=launch_id, round=round)
    return WriterLease(open_storage(url), token=token, ttl_s=60.0, wait_s=0.0, fenced=fenced)


@pytest.mark.parametrize("fenced,holder_token,expect", [
    # no agent: torchrun's next rank 0 (another process, maybe another host) of the same named run
    (False, dict(run_id="job", launch_id="pid1-a"), "takes over"),
    (False, dict(run_id="none", launch_id="pid1-a"), "refuses"),  # torchrun's default id names no job
    (False, dict(run_id="other", launch_id="pid1-a"), "refuses"),
    # under an agent: a newer round of the same launch; never another launch (a re-created k8s Job)
    (True, dict(run_id="job", launch_id="7", round=2), "takes over"),
    (True, dict(run_id="job", launch_id="6", round=2), "refuses"),
    (True, dict(run_id="job", launch_id="7", round=4), "refuses"),
], ids=["same-run", "anonymous-run", "other-run", "newer-round", "other-launch", "older-round"])
def test_who_succeeds_a_live_holder_at_once(tmp_path, fenced, holder_token, expect):
    url = f"file://{tmp_path}"
    holder = _lease(url, fenced=fenced, **holder_token)
    holder.acquire()
    my_run = "none" if holder_token["run_id"] == "none" else "job"
    mine = dict(run_id=my_run, launch_id="7" if fenced else "pid2-b", round=3)
    newcomer = _lease(url, fenced=fenced, **mine)
    try:
        if expect == "takes over":
            assert newcomer.acquire() == holder.epoch + 1
            with pytest.raises(FencedError):
                holder.check()  # the old writer commits nothing now
        else:
            with pytest.raises(CheckpointError, match="is in use by run"):
                newcomer.acquire()
            holder.check()
    finally:
        newcomer.release()
        holder.release()


def _planted_holder(tmp_path, *, pid: int, pid_ns: str) -> str:
    url = f"file://{tmp_path}"
    (tmp_path / LEASE_DIR).mkdir()
    record = LeaseRecord(epoch=1, run_id="old-job", launch_id="x", round=0, host=socket.gethostname(), pid=pid,
                         pid_ns=pid_ns, beat_unix_s=time.time(), ttl_s=60.0)
    (tmp_path / LEASE_DIR / "00000001.json").write_bytes(record.to_json())
    return url


def _gone_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def test_a_crashed_holder_on_this_host_is_taken_over_at_once(tmp_path):
    url = _planted_holder(tmp_path, pid=_gone_pid(), pid_ns=os.readlink("/proc/self/ns/pid"))
    lease = _lease(url, run_id="new-job", launch_id="y")
    try:
        assert lease.acquire() == 2
    finally:
        lease.release()


def test_a_holder_in_another_pid_namespace_is_never_taken_for_dead(tmp_path):
    """Containers sharing the host name (hostNetwork pods) have PID namespaces of their own: the holder's pid
    says nothing about it here."""
    url = _planted_holder(tmp_path, pid=_gone_pid(), pid_ns="pid:[1]")
    with pytest.raises(CheckpointError, match="is in use by run old-job"):
        _lease(url, run_id="new-job", launch_id="y").acquire()
