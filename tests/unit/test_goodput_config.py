"""The --straggler-* launch flags: defaults, values, validation."""

from __future__ import annotations

import pytest

from elastic_rt.cli import build_parser
from elastic_rt.launch_config import launch_config_from_args
from elastic_rt.errors import ConfigError
from elastic_rt.goodput.stragglers import StragglerSettings


def _cfg(*argv):
    return launch_config_from_args(build_parser().parse_args(["launch", "--standalone", *argv, "train.py"]))


def straggler_settings(cfg) -> StragglerSettings:
    return cfg.section(StragglerSettings)


def test_defaults_report_at_one_and_a_half_times_the_median_for_three_windows_of_ten_seconds():
    s = straggler_settings(_cfg())
    assert (s.threshold, s.windows, s.window_s, s.action, s.enabled) == (1.5, 3, 10.0, "report", True)


def test_flags_reach_the_settings():
    s = straggler_settings(_cfg("--straggler-threshold", "2", "--straggler-windows", "5", "--straggler-window", "30",
                                "--straggler-action", "leave"))
    assert (s.threshold, s.windows, s.window_s, s.action) == (2.0, 5, 30.0, "leave")
    assert not straggler_settings(_cfg("--straggler-threshold", "0")).enabled


@pytest.mark.parametrize("argv,words", [
    (["--straggler-threshold", "1"], "must be > 1"),
    (["--straggler-threshold", "-2"], "must be > 1"),
    (["--straggler-windows", "0"], ">= 1"),
    (["--straggler-window", "0"], "> 0"),
])
def test_bad_values_are_one_line_errors(argv, words):
    with pytest.raises(ConfigError, match=words):
        _cfg(*argv)


def test_unknown_action_is_refused_by_the_parser(capsys):
    with pytest.raises(SystemExit) as exc:
        build_parser().parse_args(["launch", "--straggler-action", "evict", "t.py"])
    assert exc.value.code == 2 and "invalid choice" in capsys.readouterr().err
