"""torchrun's flags through the real CLI parser into AgentConfig: the rendezvous they select, torchrun's value
rules, and the one-line notes for flags whose meaning differs under elastic-rt."""

from __future__ import annotations

import os

import pytest

from elastic_rt.cli import build_parser
from elastic_rt.launch_config import launch_config_from_args
from elastic_rt.errors import ConfigError
from elastic_rt.torchrun_compat import grace_period_s, virtual_local_rank_env


def cfg(*argv, environ=None):
    environ = {} if environ is None else environ
    return launch_config_from_args(build_parser(environ=environ).parse_args(["launch", *argv, "train.py"]),
                                   environ=environ)


def test_static_rendezvous_from_torchruns_flags_alone():
    c = cfg("--nnodes", "2", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "29501")
    assert (c.rdzv_backend, c.rdzv_endpoint, c.node_rank, c.min_nodes, c.max_nodes) == (
        "static", "10.0.0.1:29501", 1, 2, 2)
    assert c.rdzv_id == "none"  # torchrun's default, the same on every node
    assert any("static rendezvous" in n and "--node-rank" in n for n in c.notes)


def test_static_rendezvous_from_pet_variables_as_a_pytorchjob_sets_them():
    c = cfg(environ={"PET_NNODES": "2", "PET_NODE_RANK": "1", "PET_MASTER_ADDR": "trainer-0",
                     "PET_MASTER_PORT": "23456"})
    assert (c.rdzv_backend, c.rdzv_endpoint, c.node_rank) == ("static", "trainer-0:23456", 1)


@pytest.mark.parametrize("argv,endpoint", [
    (["--rdzv-backend", "static", "--nnodes", "2", "--node-rank", "1"], "127.0.0.1:29500"),  # torchrun's defaults
    (["--rdzv-backend", "static", "--nnodes", "2", "--rdzv-endpoint", "h:7"], "h:7"),  # the endpoint wins
    (["--nnodes", "2", "--master-port", "1234"], "127.0.0.1:1234"),
])
def test_static_endpoint(argv, endpoint):
    c = cfg(*argv)
    assert (c.rdzv_backend, c.rdzv_endpoint) == ("static", endpoint)


def test_static_on_one_node_without_a_port_is_torchruns_local_store():
    c = cfg("--rdzv-backend", "static", "--node-rank", "0")
    assert (c.rdzv_backend, c.rdzv_endpoint) == ("c10d", "localhost:0")


@pytest.mark.parametrize("argv,words", [
    (["--rdzv-backend", "static", "--nnodes", "1:2", "--master-port", "1"], "static membership is fixed"),
    (["--nnodes", "2", "--node-rank", "2", "--master-port", "1"], "between 0 and 1"),
    (["--nnodes", "2", "--node-rank", "-1", "--master-port", "1"], "between 0 and 1"),
    (["--nnodes", "2", "--rdzv-id", "j"], "--master-addr/--master-port"),
])
def test_static_rejects(argv, words):
    with pytest.raises(ConfigError, match=words):
        cfg(*argv)


def test_static_flags_with_another_backend_are_explained_not_dropped():
    c = cfg("--nnodes", "2", "--rdzv-endpoint", "etcd:2379", "--rdzv-id", "j", "--master-addr", "h", "--node-rank", "1")
    assert c.rdzv_backend == "etcd-v3"
    assert [n for n in c.notes if n.startswith("--node-rank, --master-addr: used by the static rendezvous only")]
    c = cfg("--standalone", "--master-port", "29501")
    assert [n for n in c.notes if n.startswith("--master-port: not used with --standalone")]


def test_start_method_and_run_path_are_explained():
    assert cfg().notes == ()
    c = cfg("--start-method", "fork")
    assert len(c.notes) == 1 and c.notes[0].startswith("--start-method fork: workers are new processes")
    c = cfg("--run-path", "-m")
    assert not c.run_as_module and not c.no_python
    assert c.notes == ("--run-path: SCRIPT runs with runpy.run_path; -m is not used, as under torchrun",)


@pytest.mark.parametrize("grace,shutdown,environ,expected", [
    (None, None, {}, 30.0),
    (None, 10.0, {}, 10.0),
    (12.0, None, {}, 12.0),
    (10.0, 10.0, {}, 10.0),
    (None, None, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}, 7.0),
    (None, 5.0, {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "7"}, 5.0),  # the flag wins, as in torchrun
])
def test_grace_period_and_torchruns_shutdown_timeout(grace, shutdown, environ, expected):
    assert grace_period_s(grace, shutdown, environ) == expected


def test_shutdown_timeout_flag_and_variable_through_the_parser():
    assert cfg("--shutdown-timeout", "12").grace_period_s == 12.0
    assert cfg(environ={"PET_SHUTDOWN_TIMEOUT": "9"}).grace_period_s == 9.0
    assert cfg(environ={"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "8"}).grace_period_s == 8.0
    for argv, environ, words in ((["--grace-period", "5", "--shutdown-timeout", "10"], {}, "give one"),
                                 ([], {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "soon"}, "seconds"),
                                 (["--shutdown-timeout", "-1"], {}, ">= 0")):
        with pytest.raises(ConfigError, match=words):
            cfg(*argv, environ=environ)


def test_log_flags():
    c = cfg("--local-ranks-filter", "2,0", "--duplicate-stdout-filters", "loss,,acc,step",
            "--duplicate-stderr-filters", "err", "--role", "trainer", "--event-log-handler", "console")
    assert c.local_ranks_filter == (0, 2)
    assert c.duplicate_stdout_filters == ("loss,acc", "step") and c.duplicate_stderr_filters == ("err",)
    assert (c.role, c.event_log_handler, c.logs_specs) == ("trainer", "console", None)


@pytest.mark.parametrize("argv,words", [
    (["--local-ranks-filter", "0,x"], "--local-ranks-filter"),
    (["--local-ranks-filter", "-1"], ">= 0"),
    (["--event-log-handler", "kafka"], "console"),
    (["--logs-specs", "no-such-specs"], "no entry point of that name in the torchrun.logs_specs group"),
])
def test_log_flags_reject(argv, words):
    with pytest.raises(ConfigError, match=words):
        cfg(*argv)


def test_virtual_local_rank():
    c = cfg("--virtual-local-rank", "--nproc-per-node", "2", environ={"CUDA_VISIBLE_DEVICES": "3,5"})
    assert c.virtual_local_rank
    with pytest.raises(ConfigError, match="names fewer devices"):
        cfg("--virtual-local-rank", "--nproc-per-node", "3", environ={"CUDA_VISIBLE_DEVICES": "3,5"})
    # torch's rule (torch/distributed/elastic/agent/server/local_elastic_agent.py)
    assert virtual_local_rank_env(1, {"CUDA_VISIBLE_DEVICES": "3, 5"}) == {"CUDA_VISIBLE_DEVICES": "5"}
    assert virtual_local_rank_env(1, {}) == {"CUDA_VISIBLE_DEVICES": "1"}


def test_numa_binding_is_a_torch_mode():
    assert cfg("--numa-binding", "exclusive").numa_binding == "exclusive"
    with pytest.raises(SystemExit):
        cfg("--numa-binding", "everything")


def test_numa_binding_that_torch_cannot_do_is_one_config_error():
    """Without CUDA torch cannot tell which NUMA node a GPU is on: the launch stops at start in one line (under
    torchrun each worker fails with a traceback)."""
    import torch

    from elastic_rt.worker.numa import check_binding

    if torch.cuda.is_available():
        pytest.skip("CUDA present: torch can bind here")
    with pytest.raises(ConfigError, match=r"--numa-binding node: torch cannot bind local rank 0 \(.+\); it binds"):
        check_binding("node", 1)


def test_nproc_per_node_words_as_torchrun():
    import torch

    assert cfg("--nproc-per-node", "cpu").nproc_per_node == torch._utils.cpu_count()
    if not torch.cuda.is_available():
        assert cfg("--nproc-per-node", "auto").nproc_per_node == torch._utils.cpu_count()
        with pytest.raises(ConfigError, match="--nproc-per-node gpu"):
            cfg("--nproc-per-node", "gpu")
    with pytest.raises(ConfigError, match="positive integer"):
        cfg("--nproc-per-node", "-2")


def test_static_handler_gets_torchruns_rank_and_timeout():
    from torch.distributed.elastic.rendezvous.static_tcp_rendezvous import StaticTCPRendezvous

    from elastic_rt.launch import build_handler

    before = os.environ.get("TORCH_DISABLE_SHARE_RDZV_TCP_STORE")
    try:
        handler = build_handler(cfg("--nnodes", "2", "--node-rank", "1", "--master-port", "29511"))
    finally:  # build_handler sets it for the process, as for torch's other backends
        if before is None:
            os.environ.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    assert isinstance(handler, StaticTCPRendezvous)
    assert (handler.rank, handler.world_size, handler.master_port, handler.timeout.total_seconds()) == (1, 2, 29511, 900)
