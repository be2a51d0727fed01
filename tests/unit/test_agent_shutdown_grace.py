"""The agent hands torch its shutdown grace in seconds as given: a fraction is not truncated to 0."""

from __future__ import annotations

from types import SimpleNamespace

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs

from elastic_rt.agent.agent import ElasticRTAgent
from elastic_rt.worker_reports.inbox import WorkerReports


def test_a_fractional_shutdown_grace_reaches_torch_unchanged(tmp_path):
    spec = SimpleNamespace(rdzv_handler=None, role="default", local_world_size=1, max_restarts=0)
    agent = ElasticRTAgent(spec, DefaultLogsSpecs(log_dir=str(tmp_path)), node_id="n",
                           reports=WorkerReports(str(tmp_path / "reports")),
                           shutdown_grace_s=0.5)
    assert agent._shutdown_timeout == 0.5
