"""One writer per URL: the writer lease refuses a second job, names the holder, hands over on release."""

from __future__ import annotations

import pytest
import torch

from elastic_rt.checkpoint import CheckpointManager
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
