"""Every flag of torchrun, read from torch's own parser at test time, is taken by `elastic-rt launch` under
each of its spellings, with the value torchrun would parse, and from the same PET_* variable.

A torch release that adds or renames a flag fails here, naming it.
"""

from __future__ import annotations

import argparse

import pytest
from torch.distributed.run import get_args_parser

from elastic_rt import torchrun_compat
from elastic_rt.cli import build_parser
from elastic_rt.errors import ConfigError
from tests.support import cli_docs

# A value torchrun accepts for each flag, chosen away from the defaults so that taking it shows.
# A flag missing here (a new torch flag) is tried with "1".
SAMPLES = {
    "nnodes": "2:4", "nproc_per_node": "2", "rdzv_backend": "c10d", "rdzv_endpoint": "etcd1:2379",
    "rdzv_id": "job42", "rdzv_conf": "join_timeout=5", "max_restarts": "2", "monitor_interval": "0.5",
    "event_log_handler": "console", "role": "trainer", "log_dir": "/tmp/logs", "redirects": "3",
    "tee": "0:1,1:2", "local_ranks_filter": "0,1", "duplicate_stdout_filters": "loss,,acc,step",
    "duplicate_stderr_filters": "error", "node_rank": "1", "master_addr": "10.0.0.1", "master_port": "29501",
    "local_addr": "10.0.0.2", "logs_specs": "custom", "signals_to_handle": "SIGTERM,SIGUSR1",
    "shutdown_timeout": "10",
}


def _clean_env(monkeypatch) -> None:
    import os

    for key in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)


@pytest.fixture
def torchrun(monkeypatch) -> argparse.ArgumentParser:
    _clean_env(monkeypatch)
    return get_args_parser()


def _options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and a.dest != "help"]


def _argv(action: argparse.Action, option: str) -> list[str]:
    if action.nargs == 0:
        return [option]
    value = action.choices[-1] if action.choices else SAMPLES.get(action.dest, "1")
    return [option, value]


def _ours(argv: list[str], environ: dict[str, str] | None = None) -> argparse.Namespace:
    return build_parser(environ=environ or {}).parse_args(["launch", *argv, "train.py"])


def test_torch_has_the_flags_this_test_knows(torchrun):
    """The premise: torchrun's parser is where this test reads the flags from (30 in torch 2.13)."""
    dests = {a.dest for a in _options(torchrun)}
    assert {"nnodes", "node_rank", "numa_binding", "virtual_local_rank", "shutdown_timeout"} <= dests
    assert len(dests) >= 30


def test_every_torchrun_flag_and_spelling_is_accepted_with_torchruns_value(torchrun, capsys):
    launch = cli_docs._parsers()[1]._option_string_actions  # exact spellings: no abbreviation of another flag
    rejected, differ = [], {}
    for action in _options(torchrun):
        for option in action.option_strings:
            argv = _argv(action, option)
            theirs = getattr(torchrun.parse_args([*argv, "train.py"]), action.dest)
            if option not in launch or launch[option].dest != action.dest:
                rejected.append(" ".join(argv))
                continue
            try:
                ours = getattr(_ours(argv), action.dest)
            except SystemExit:
                rejected.append(" ".join(argv))
                continue
            if ours != theirs:
                differ[" ".join(argv)] = (theirs, ours)
    err = capsys.readouterr().err
    assert rejected == [], f"elastic-rt launch rejects torchrun's {rejected}:\n{err}"
    assert differ == {}, f"parsed differently (torchrun, elastic-rt): {differ}"


def test_every_torchrun_choice_is_accepted(torchrun):
    launch = {a.dest: a for a in _options(cli_docs._parsers()[1])}
    for action in _options(torchrun):
        if action.choices:
            assert list(launch[action.dest].choices) == list(action.choices), action.dest
    from torch.numa.binding import AffinityMode

    assert torchrun_compat.NUMA_MODES == tuple(m.value for m in AffinityMode)


def _pet_value(action: argparse.Action) -> str:
    return "1" if action.nargs == 0 else _argv(action, action.option_strings[0])[1]


def test_pet_variables_are_the_defaults_torchrun_takes_from_them(monkeypatch):
    """torch's `env` and `check_env` flags take PET_<DEST>; its plain ones (--logs-specs, --numa-binding) do not."""
    _clean_env(monkeypatch)
    plain = get_args_parser()
    differ, read = {}, []
    for action in _options(plain):
        name = f"PET_{action.dest.upper()}"
        value = _pet_value(action)
        monkeypatch.setenv(name, value)
        theirs = getattr(get_args_parser().parse_args(["train.py"]), action.dest)
        monkeypatch.delenv(name)
        ours = getattr(_ours([], {name: value}), action.dest)
        if ours != theirs:
            differ[f"{name}={value}"] = (theirs, ours)
        if theirs != getattr(plain.parse_args(["train.py"]), action.dest):
            read.append(action.dest)
    assert differ == {}, f"PET_* defaults differ (torchrun, elastic-rt): {differ}"
    assert set(read) == torchrun_compat.ENV_DESTS | torchrun_compat.SWITCH_DESTS  # the premise: torch reads these


@pytest.mark.parametrize("name,value,words", [
    ("PET_STANDALONE", "yes", "expected 0 or 1"),
    ("PET_MAX_RESTARTS", "many", "--max-restarts"),
    ("PET_START_METHOD", "thread", "spawn, fork, forkserver"),
    ("PET_NODE_RANK", "first", "--node-rank"),
])
def test_a_bad_pet_variable_is_one_config_error(name, value, words):
    with pytest.raises(ConfigError, match=words):
        build_parser(environ={name: value})


def test_the_command_line_wins_over_pet_variables():
    args = _ours(["--nnodes", "3", "--max-restarts", "0"], {"PET_NNODES": "2:4", "PET_MAX_RESTARTS": "5",
                                                           "PET_ROLE": "trainer"})
    assert (args.nnodes, args.max_restarts, args.role) == ("3", 0, "trainer")
