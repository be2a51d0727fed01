"""The hang, stack-dump and flight recorder flags, through the real CLI parser."""

from __future__ import annotations

import signal

import pytest

from elastic_rt.diagnostics.failure_diagnostics import DiagnosticsSettings
from elastic_rt.cli import build_parser
from elastic_rt.launch_config import launch_config_from_args
from elastic_rt.errors import ConfigError


def cfg(*argv):
    return launch_config_from_args(build_parser().parse_args(["launch", "--standalone", *argv, "train.py"])).section(
        DiagnosticsSettings)


def test_defaults_auto_hang_timeout_and_a_real_time_stack_signal():
    c = cfg()
    assert c.hang_timeout_s is None and c.stack_signal == int(signal.SIGRTMIN) + 6 and c.flight_recorder == "auto"


@pytest.mark.parametrize("flag,expected", [("auto", None), ("AUTO", None), ("0", 0.0), ("90", 90.0), ("2.5", 2.5)])
def test_hang_timeout(flag, expected):
    assert cfg("--hang-timeout", flag).hang_timeout_s == expected


@pytest.mark.parametrize("flag", ["-1", "soon", ""])
def test_hang_timeout_rejects(flag):
    with pytest.raises(ConfigError, match="--hang-timeout"):
        cfg("--hang-timeout", flag)


@pytest.mark.parametrize("flag,expected", [("off", None), ("SIGUSR2", int(signal.SIGUSR2)), ("rtmin+2", 36)])
def test_stack_signal(flag, expected):
    assert cfg("--stack-signal", flag).stack_signal == expected


@pytest.mark.parametrize("flag", ["SIGKILL", "SIGSEGV", "SIGTERM", "15", "SIGNOPE", "99"])
def test_stack_signal_rejects(flag):
    with pytest.raises(ConfigError, match="--stack-signal"):
        cfg("--stack-signal", flag)


def test_flight_recorder_choices():
    assert cfg("--flight-recorder", "on").flight_recorder == "on"
    with pytest.raises(SystemExit):
        cfg("--flight-recorder", "maybe")
