"""Flag parsing and validation (pure logic)."""

from __future__ import annotations

import pytest

from elastic_rt.cli import build_parser
from elastic_rt.collectors.schedule import CollectorSettings
from elastic_rt.launch_config import launch_config_from_args, parse_nnodes
from elastic_rt.decisions import DetectionAction
from elastic_rt.errors import ConfigError
from elastic_rt.goodput.stragglers import StragglerSettings
from elastic_rt.rendezvous.conf import parse_rdzv_conf
from elastic_rt.rendezvous.keys import RunKeys
from elastic_rt.rendezvous.registration import parse_endpoints


@pytest.mark.parametrize("text,expected", [("1", (1, 1)), ("4", (4, 4)), ("2:4", (2, 4)), (" 1:2 ", (1, 2))])
def test_parse_nnodes(text, expected):
    assert parse_nnodes(text) == expected


@pytest.mark.parametrize("text,words", [("3:2", "larger"), ("0", "at least 1"), ("0:2", "at least 1"),
                                         ("a", "expected"), ("1:", "expected"), ("", "expected")])
def test_parse_nnodes_rejects(text, words):
    with pytest.raises(ConfigError, match=words):
        parse_nnodes(text)


def test_parse_rdzv_conf():
    assert parse_rdzv_conf("a=1, b = x ,") == {"a": "1", "b": "x"}
    with pytest.raises(ConfigError):
        parse_rdzv_conf("novalue")


def test_parse_endpoints():
    assert parse_endpoints("h1:2379,h2, http://h3:1/ ,[::1]:5") == (("h1", 2379), ("h2", 2379), ("h3", 1), ("::1", 5))
    for bad in ("", "h:0", "h:99999", "a:b:c"):
        with pytest.raises(ConfigError):
            parse_endpoints(bad)


def _cfg(*argv):
    args = build_parser().parse_args(["launch", *argv])
    return launch_config_from_args(args)


def test_launch_config_multi_node():
    c = _cfg("--nnodes", "2:4", "--nproc-per-node", "8", "--rdzv-endpoint", "etcd:2379", "--rdzv-id", "job1",
             "--rdzv-conf", "lease_ttl=2", "train.py", "--lr", "0.1")
    assert (c.min_nodes, c.max_nodes, c.nproc_per_node, c.rdzv_backend) == (2, 4, 8, "etcd-v3")
    assert c.script == "train.py" and c.script_args == ("--lr", "0.1")
    assert c.conf == {"lease_ttl": "2"}


def test_standalone_uses_embedded_store():
    c = _cfg("--standalone", "--nproc-per-node", "2", "train.py")
    assert (c.min_nodes, c.max_nodes, c.rdzv_backend, c.rdzv_endpoint) == (1, 1, "c10d", "localhost:0")


@pytest.mark.parametrize("argv,words", [
    (["--nnodes", "2", "--rdzv-id", "j", "t.py"], "--rdzv-endpoint is required"),
    (["--nnodes", "2", "--rdzv-endpoint", "e:1", "t.py"], "--rdzv-id is required"),
    (["--rdzv-backend", "zookeeper", "--rdzv-endpoint", "e:1", "t.py"], "unknown"),
    (["--nnodes", "2", "--rdzv-endpoint", "e:1", "--rdzv-id", "bad/id", "t.py"], "invalid --rdzv-id"),
    (["--nproc-per-node", "0", "t.py"], "positive"),
    (["--standalone", "--nnodes", "2", "t.py"], "--standalone"),
    (["--standalone"], "no training script"),
])
def test_launch_config_rejects(argv, words):
    with pytest.raises(ConfigError, match=words):
        _cfg(*argv)


def test_run_keys_layout_sorts_rounds_numerically():
    k = RunKeys("job")
    assert k.join(2, "n1") == "/elastic-rt/job/joins/0000000002/n1"
    assert k.round_prefix(9) < k.round_prefix(10)


def _env_cfg(environ, *argv):
    return launch_config_from_args(build_parser().parse_args(["launch", *argv, "t.py"]), environ=environ)


@pytest.mark.parametrize("nproc,environ,omp,warn", [
    ("2", {}, "1", True),                        # torchrun's rule: several workers, nothing set
    ("1", {}, None, False),                      # one worker per node: left alone
    ("2", {"OMP_NUM_THREADS": "4"}, None, False),  # the user's value stays (inherited, not overridden)
    ("2", {"OMP_NUM_THREADS": ""}, None, False),   # set, even empty: torchrun keeps it too
])
def test_worker_env_omp_num_threads(nproc, environ, omp, warn):
    c = _env_cfg(environ, "--standalone", "--nproc-per-node", nproc)
    assert dict(c.worker_env).get("OMP_NUM_THREADS") == omp
    assert c.omp_threads_defaulted is warn
    assert dict(c.worker_env)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"


def test_signals_to_handle_validated():
    c = _env_cfg({}, "--standalone", "--signals-to-handle", " SIGTERM , SIGUSR1")
    assert dict(c.worker_env)["TORCHELASTIC_SIGNALS_TO_HANDLE"] == "SIGTERM,SIGUSR1"
    for bad in ("SIGNOPE", "", "SIGTERM,15"):
        with pytest.raises(ConfigError, match="--signals-to-handle"):
            _env_cfg({}, "--standalone", "--signals-to-handle", bad)


@pytest.mark.parametrize("flag, section, field", [("--probe-failure-action", CollectorSettings, "probe_failure_action"),
                                                  ("--straggler-action", StragglerSettings, "action")])
def test_detection_action_flags_take_the_enum_words(flag, section, field, capsys):
    """The flags' choices are DetectionAction's values, and the config carries the enum itself."""
    base = ["--rdzv-endpoint", "etcd:2379", "--rdzv-id", "job1", "train.py"]
    assert getattr(_cfg(*base).section(section), field) is DetectionAction.REPORT
    for action in DetectionAction:
        assert getattr(_cfg(flag, str(action), *base).section(section), field) is action
    with pytest.raises(SystemExit) as exc:
        _cfg(flag, "ignore", *base)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "invalid choice: 'ignore'" in err
    assert all(repr(str(a)) in err or str(a) in err.split("choose from")[1] for a in DetectionAction)
