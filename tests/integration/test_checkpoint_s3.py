"""Checkpoints on s3:// through s3fs, against a real S3 server process (moto's standalone server)."""

from __future__ import annotations

import logging
import os
import signal
import uuid

import pytest
import torch

from elastic_rt.checkpoint import CheckpointManager
from elastic_rt.checkpoint.backends import ObjectStorage, open_storage
from elastic_rt.checkpoint.storage import CheckpointStore
from elastic_rt.errors import CheckpointError
from tests.chaos.harness import EXAMPLE, Node
from tests.support.s3 import (INTERNAL, SECRET_KEY, SLOW_DOWN, Fault, FaultShim, MotoServer, client_env, make_bucket,
                              storage_options)

pytest.importorskip("s3fs")


@pytest.fixture(scope="module")
def s3():
    server = MotoServer()
    make_bucket(server.endpoint, "ckpt")
    yield server
    server.stop()


@pytest.fixture
def url(s3):
    return f"s3://ckpt/run-{uuid.uuid4().hex[:8]}"


def state_at(step: int) -> dict:
    torch.manual_seed(step)
    return {"model": {"w": torch.randn(256, 64), "b": torch.randn(64)}, "extra": {"step": step}}


def empty() -> dict:
    return {"model": {"w": torch.zeros(256, 64), "b": torch.zeros(64)}, "extra": {"step": -1}}


def test_save_load_and_retention_on_s3(s3, url):
    opts = storage_options(s3.endpoint)
    with CheckpointManager(url, keep_last=2, storage_options=opts) as mgr:
        for step in (10, 20, 30):
            assert mgr.save(step, state_at(step)) is True
        assert [(e.step, e.committed) for e in mgr.list_checkpoints()] == [(20, True), (30, True)]
    target = empty()
    with CheckpointManager(url, storage_options=opts) as mgr:
        assert mgr.load_latest(target) == 30
    assert torch.equal(target["model"]["w"], state_at(30)["model"]["w"]) and target["extra"] == {"step": 30}


def test_the_commit_is_a_conditional_put_that_never_replaces(s3, url):
    storage = open_storage(url, storage_options(s3.endpoint))
    assert isinstance(storage, ObjectStorage)
    storage.create(f"{storage.root}/MANIFEST.json", b"first")
    with pytest.raises(FileExistsError):
        storage.create(f"{storage.root}/MANIFEST.json", b"second")
    assert storage.read(f"{storage.root}/MANIFEST.json") == b"first"


def test_a_re_save_of_a_step_on_s3_commits_the_next_generation(s3, url):
    opts = storage_options(s3.endpoint)
    with CheckpointManager(url, storage_options=opts) as mgr:
        mgr.save(5, state_at(5))
        mgr.save(5, state_at(6))
        target = empty()
        assert mgr.load_latest(target) == 5
    assert torch.equal(target["model"]["w"], state_at(6)["model"]["w"])
    assert [c.generation for c in CheckpointStore(url, opts).entry(5).commits] == [1, 2]


def test_throttling_and_server_errors_are_retried(s3, url):
    bucket_path = "/ckpt/" + url.split("/", 3)[3]
    shim = FaultShim(upstream_port=s3.port, faults=[
        Fault(match=lambda m, p: m == "PUT" and "MANIFEST" in p, times=2, answer=SLOW_DOWN),
        Fault(match=lambda m, p: m == "PUT" and ".distcp" in p, times=1, answer=INTERNAL),
        Fault(match=lambda m, p: m == "GET" and p.startswith(bucket_path) and "MANIFEST" in p, times=1,
              answer=SLOW_DOWN),
    ])
    try:
        opts = storage_options(shim.endpoint)
        with CheckpointManager(url, storage_options=opts) as mgr:
            assert mgr.save(1, state_at(1)) is True
        target = empty()
        with CheckpointManager(url, storage_options=opts) as mgr:
            assert mgr.load_latest(target) == 1
        assert torch.equal(target["model"]["b"], state_at(1)["model"]["b"])
        answered = [status for _, _, status in shim.seen]
        assert answered.count(503) == 3 and answered.count(500) == 1
    finally:
        shim.close()


def test_an_unreachable_endpoint_is_one_line_and_never_logs_the_secret_key(url, caplog):
    dead = storage_options("http://127.0.0.1:9")  # nothing listens on the discard port
    dead["config_kwargs"] = {"retries": {"max_attempts": 1}, "connect_timeout": 1}
    with caplog.at_level(logging.DEBUG):
        with pytest.raises(CheckpointError) as exc_info:
            with CheckpointManager(url, storage_options=dead) as mgr:
                mgr.load_latest(empty())
    text = str(exc_info.value)
    assert "\n" not in text and url in text
    assert SECRET_KEY not in text
    assert not any(SECRET_KEY in r.getMessage() for r in caplog.records)


def test_credentials_never_reach_the_logs_of_a_save(s3, url, caplog):
    with caplog.at_level(logging.DEBUG):
        with CheckpointManager(url, storage_options=storage_options(s3.endpoint)) as mgr:
            mgr.save(1, state_at(1))
            mgr.load_latest(empty())
    assert caplog.records  # botocore and s3fs did log at DEBUG
    assert not any(SECRET_KEY in r.getMessage() for r in caplog.records)


@pytest.mark.long  # for CI's time: the S3 tests above run the same manager against moto
@pytest.mark.slow
def test_the_example_job_saves_to_and_resumes_from_s3_under_elastic_rt_launch(s3, url):
    """launch/train_example.py, unchanged, under `elastic-rt launch --checkpoint-url s3://...`: the credentials and
    the endpoint reach s3fs through botocore's own variables. A worker is SIGKILLed after a save; the restarted
    group resumes from S3 (nothing else holds the checkpoint: the host-memory copy is kept for local disks only)."""
    job = ["--steps", "30", "--save-every", "10", "--dataset-size", "200", "--step-sleep", "0.2"]
    node = Node(["--standalone", "--nproc-per-node", "2", "--metrics-port", "0", "--tee", "3",
                 "--checkpoint-url", url, EXAMPLE, *job], name="s3-job", env=client_env(s3.endpoint))
    try:
        saved = int(node.wait_for(r"\]:checkpoint saved step=(\d+) ", 240).group(1))
        os.kill(node.worker_pid(1), signal.SIGKILL)
        resumed = int(node.wait_for(r"\]:start step=(\d+) world_size=2 .*restart=1", 180).group(1))
        assert node.wait_exit(240) == 0, node.output[-3000:]
    finally:
        node.cleanup()
    assert resumed >= saved and resumed % 10 == 0, node.output[-3000:]
    assert node.matches(r"\]:done steps=30 world_size=2 ")
    assert SECRET_KEY not in node.output
    store = CheckpointStore(url, storage_options(s3.endpoint))
    committed = {e.step: e for e in store.list() if e.committed}
    assert resumed in committed and 30 in committed, sorted(committed)
    for entry in committed.values():
        assert not store.verify_files(entry.data_dir(entry.manifest), entry.manifest.files), entry.step
