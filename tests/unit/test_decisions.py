"""The decision vocabulary: label values that dashboards match on stay put, each reason's handling is declared
with it, and no code in the package decides by comparing strings with these values."""

from __future__ import annotations

import ast
import json
import pathlib

import pytest

import elastic_rt
from elastic_rt.decisions import DetectionAction, FailureCause, Response, RestartReason
from elastic_rt.diagnostics.failure_metrics import FAILURE_CAUSES
from elastic_rt.metrics.definitions import RESTART_REASONS

PACKAGE = pathlib.Path(elastic_rt.__file__).parent


def test_label_values_that_dashboards_and_alerts_match_on_are_unchanged():
    assert RESTART_REASONS == ("worker_failure", "peer_lost", "round_advanced", "scale_up", "hang", "probe_failure")
    assert FAILURE_CAUSES == ("exception", "oom", "killed", "signal", "collective_timeout", "collective_error",
                              "hang", "exit")
    assert [a.value for a in DetectionAction] == ["report", "leave"]


@pytest.mark.parametrize("member", [*RestartReason, *FailureCause, *DetectionAction, *Response])
def test_a_member_reads_as_its_value_everywhere_text_is_made(member):
    assert str(member) == f"{member}" == "%s" % member == member.value
    assert json.loads(json.dumps({"v": member})) == {"v": member.value}
    assert type(member)(member.value) is member


def test_each_reason_declares_its_handling():
    leave = {r for r in RestartReason if r.response is Response.LEAVE}
    assert leave == {RestartReason.PROBE_FAILURE, RestartReason.STRAGGLER}
    for reason in leave:  # the log line names what was detected and the flag that chose to leave
        assert reason.summary and reason.hint.endswith(" leave") and not reason.counted
    assert [r for r in RestartReason if r.response is Response.STOP] == [RestartReason.CRASH_LOOP]
    assert {r for r in RestartReason if r.counted} == {RestartReason.WORKER_FAILURE, RestartReason.HANG}
    assert {r for r in RestartReason if r.broken} == {RestartReason.WORKER_FAILURE, RestartReason.PEER_LOST}
    assert RestartReason.PEER_LOST.words == "peer lost" == RestartReason.PEER_LOST.summary
    assert [c for c in FailureCause if c.collective] == [FailureCause.COLLECTIVE_TIMEOUT,
                                                         FailureCause.COLLECTIVE_ERROR]


def test_an_unknown_value_is_refused():
    with pytest.raises(ValueError):
        RestartReason("cosmic_ray")
    with pytest.raises(ValueError):
        DetectionAction("shrug")


def _string_decisions(path: pathlib.Path) -> list[tuple[int, str]]:
    """(line, value) of each comparison with, or return of, a string literal that is a vocabulary value."""
    words = {m.value for e in (RestartReason, FailureCause, DetectionAction, Response) for m in e}
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            operands += [e for o in operands if isinstance(o, (ast.Tuple, ast.List, ast.Set)) for e in o.elts]
        elif isinstance(node, ast.Return):
            operands = [node.value]
        else:
            continue
        found += [(node.lineno, o.value) for o in operands
                  if isinstance(o, ast.Constant) and isinstance(o.value, str) and o.value in words]
    return found


def test_no_decision_is_made_by_matching_strings():
    # report/ reads the goodput journal back, whose event names ("restart", "straggler", "exit") are the
    # journal's own vocabulary, not these decisions.
    offenders = {str(p.relative_to(PACKAGE)): hits for p in sorted(PACKAGE.rglob("*.py"))
                 if p.parent.name != "report" and (hits := _string_decisions(p))}
    assert offenders == {}


def test_the_lint_finds_string_decisions(tmp_path):
    source = tmp_path / "agent.py"
    source.write_text("def f(change):\n    if change in ('peer_lost', 'x'):\n        return 'hang'\n"
                      "    return 'fine' if change == 'oom' else None\n")
    assert _string_decisions(source) == [(2, "peer_lost"), (3, "hang"), (4, "oom")]
