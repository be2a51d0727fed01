"""require_tool: a missing tool skips a test outside CI and fails it under CI=true."""

from __future__ import annotations

import pytest

from tests.support.tools import in_ci, require_tool


def test_a_present_tool_runs_the_test(monkeypatch):
    monkeypatch.setenv("CI", "true")
    require_tool("promtool", True, "apt-get install prometheus")


def test_a_missing_tool_skips_outside_ci_with_the_reason(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match=r"promtool not installed \(apt-get install prometheus\)"):
        require_tool("promtool", False, "apt-get install prometheus")


def test_a_missing_tool_fails_under_ci(monkeypatch):
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="promtool is missing under CI=true"):
        require_tool("promtool", False, "apt-get install prometheus")


@pytest.mark.parametrize(("value", "expected"), [("true", True), ("1", True), ("TRUE", True), ("", False),
                                                 ("false", False), ("0", False)])
def test_ci_values(value, expected):
    assert in_ci({"CI": value}) is expected
