"""The agent ends its round listeners' store when its run ends: a check thread still writing when the job finishes
(the collective probe and the clock skew run in the background of the round) writes nothing more to etcd, so the
run's last agent can remove every key of the run. A real agent, a real etcd-v3 rendezvous, a real worker process."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from torch.distributed.elastic.agent.server.api import WorkerSpec
from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.agent.agent import ElasticRTAgent
from elastic_rt.errors import RoundOverError
from elastic_rt.rendezvous.etcd_client import prefix_end
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from elastic_rt.worker_reports.inbox import WorkerReports


@pytest.fixture
def agent_environ():
    """The agent sets its workers' variables in its own process (this one): put back what was there after."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class _Writer:
    """A round listener that starts a thread writing keys to the round's store until the store refuses."""

    def __init__(self) -> None:
        self.written = 0
        self.stopped_by: BaseException | None = None
        self.started = threading.Event()
        self.thread: threading.Thread | None = None

    def __call__(self, *, round, store, group_rank, group_world_size, master_addr=None):
        self.thread = threading.Thread(target=self._loop, args=(store,), daemon=True)
        self.thread.start()

    def _loop(self, store) -> None:
        try:
            while True:
                store.set(f"check/{self.written}", "x")
                self.written += 1
                self.started.set()
        except BaseException as exc:  # noqa: BLE001 - what stopped it is the test's subject
            self.stopped_by = exc


def test_a_check_writing_when_the_job_ends_writes_nothing_after_run(etcd_endpoint, etcd_client, run_id, tmp_path,
                                                                   agent_environ):
    handler = create_etcd_v3_handler(RendezvousParameters(
        "etcd-v3", etcd_endpoint, run_id, 1, 1, local_addr="127.0.0.1", node_id="a"))
    writer = _Writer()
    # the worker exits once the check has written: the job ends while the check is still writing
    flag = tmp_path / "written"
    script = ("import os, sys, time\n"
              "deadline = time.monotonic() + 60\n"
              f"while not os.path.exists({str(flag)!r}) and time.monotonic() < deadline: time.sleep(0.01)\n")
    spec = WorkerSpec(role="default", local_world_size=1, rdzv_handler=handler, entrypoint=sys.executable,
                      args=("-c", script), max_restarts=0, monitor_interval=0.05)
    agent = ElasticRTAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path / "logs")), node_id="a",
                           reports=WorkerReports(str(tmp_path / "reports")), round_listeners=(writer,))
    watcher = threading.Thread(target=lambda: writer.started.wait(60) and flag.touch(), daemon=True)
    watcher.start()
    try:
        result = agent.run()
        assert not result.is_failed(), result.failures
        writer.thread.join(30)
        assert not writer.thread.is_alive(), "the check still writes after the agent's run() returned"
        assert isinstance(writer.stopped_by, RoundOverError), writer.stopped_by
        written = writer.written
        base = f"/elastic-rt/{run_id}/"
        keys = [kv.key for kv in etcd_client.read_ranges([(base, prefix_end(base))],
                                                         keys_only=frozenset({0}))[0][0] if "/check/" in kv.key]
        # every write that returned is there, and none came after: the count is final
        assert written > 0 and len(keys) == written, (written, len(keys))
    finally:
        handler.leave()
        handler.close()
