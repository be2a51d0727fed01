"""`elastic-rt report` on journals written by the real EventLog with injected clocks: incidents across
nodes, goodput totals, stragglers, the plot, and one-line errors."""

from __future__ import annotations

import importlib.util
import re

import pytest

from elastic_rt.cli import main
from elastic_rt.goodput.events import EventLog, journal_path
from elastic_rt.report.command import render
from elastic_rt.report.timeline import load
from tests.support.tools import require_tool

T0 = 1.7e9


def _write(log_dir, node: str, pid: int, events: list[tuple[float, str, dict]]) -> None:
    now = [0.0]
    log = EventLog(journal_path(str(log_dir), node), run_id="job", node=node, clock=lambda: now[0],
                   wall_clock=lambda: T0 + now[0])
    log._base["pid"] = pid
    for t, kind, fields in events:
        now[0] = t
        log.write(kind, **fields)
    log.close()


def _totals(**kw) -> dict:
    base = dict.fromkeys(("productive", "startup", "restart", "checkpoint", "restore", "lost", "other"), 0.0)
    return {**base, **kw}


@pytest.fixture
def two_nodes(tmp_path):
    _write(tmp_path / "a", "a", 10, [
        (0, "start", {}), (2, "rendezvous", {"round": 0, "world_size": 4, "nodes": 2, "duration_s": 1.5}),
        (2.1, "workers_started", {"phase": "startup"}), (5, "first_step", {"step": 1, "phase": "training"}),
        (9, "checkpoint", {"step": 40, "save_duration_s": 0.2, "blocked_s": 0.2}),
        (11.9, "failure", {"rank": 1, "cause": "cause=exception: ValueError: boom at my_train.py:33 in step"}),
        (12, "restart", {"reason": "worker_failure", "phase": "restart", "committed_step": 40}),
        (14, "rendezvous", {"round": 1, "world_size": 4, "nodes": 2, "duration_s": 1.0}),
        (14.1, "lost", {"steps": 25, "seconds": 2.5}), (14.1, "workers_started", {"phase": "restore"}),
        (16, "first_step", {"step": 41, "phase": "training"}),
        (30, "finished", {"state": "succeeded", "phase": "other", "after_last_step_s": 0.5}),
        (30.2, "exit", {"ratio": 0.6, "uncommitted_s": 0.0,
                        "totals": _totals(productive=17.3, startup=5, restart=2.1, checkpoint=0.2, restore=1.9,
                                          lost=2.5, other=1.2)}),
    ])
    _write(tmp_path / "b", "b", 20, [
        (0.5, "start", {}), (2, "rendezvous", {"round": 0, "world_size": 4, "nodes": 2, "duration_s": 1.4}),
        (2.1, "workers_started", {"phase": "startup"}), (5, "first_step", {"step": 1, "phase": "training"}),
        (13, "restart", {"reason": "round_advanced", "phase": "restart"}),
        (14, "rendezvous", {"round": 1, "world_size": 4, "nodes": 2, "duration_s": 0.9}),
        (14.1, "lost", {"steps": 25, "seconds": 3.5}), (14.1, "workers_started", {"phase": "restore"}),
        (16.5, "first_step", {"step": 41, "phase": "training"}),
        (20, "straggler", {"local_rank": 1, "ratio": 2.5, "step_time_s": 0.25, "median_s": 0.1, "windows": 3,
                           "action": "report"}),
        (25, "totals", {"ratio": 0.5, "uncommitted_s": 4.0,
                        "totals": _totals(productive=8, startup=4.5, restart=1.1, restore=2.4, lost=3.5)}),
        (27, "checkpoint", {"step": 80, "save_duration_s": 0.2, "blocked_s": 0.2}),
    ])  # b was killed at 27: no exit line
    return tmp_path


def test_restarts_of_both_nodes_are_one_incident(two_nodes):
    t = load([str(two_nodes)])
    assert t.nodes == ["a", "b"] and len(t.sources) == 2
    (inc,) = t.incidents()
    assert inc.causes == (("a", "worker_failure (rank 1 cause=exception: ValueError: boom at my_train.py:33 in step)"),
                          ("b", "round_advanced"))
    assert inc.start == pytest.approx(T0 + 12) and inc.recovery_s == pytest.approx(4.5)
    assert inc.lost_steps == 25 and inc.lost_s == pytest.approx(6.0)
    assert [w for _, w in t.world_sizes()] == [4, 4, 0, 0, 4, 4, 0]
    phases = [p for p, _, _ in t.sessions[0].segments()]
    assert phases == ["startup", "training", "lost", "restart", "restore", "training", "other"]


def test_render_prints_restarts_goodput_and_stragglers(two_nodes):
    text = render(load([str(two_nodes / "a"), str(two_nodes / "b")]))
    assert "Restarts: 1" in text
    # the classified cause beside the restart reason, its file name spelt as it is
    assert "a: worker failure (rank 1 cause=exception: ValueError: boom at my_train.py:33 in step); " \
           "b: round advanced" in text
    assert "worker failed: rank 1 cause=exception" in text
    assert "progress lost: 25 step(s)" in text
    assert "1 agent(s) wrote no exit line" in text
    assert re.search(r"not accounted \(no exit line\) +2\.0 s", text)  # b's last line came 2 s after its totals
    assert "node b local rank 1: 2.50x the median for 3 window(s)" in text
    productive = next(line for line in text.splitlines() if line.strip().startswith("productive training"))
    assert "25.3 s" in productive
    assert "no exit line (killed?)" in text


def test_report_command_prints_the_timeline(two_nodes, capsys):
    assert main(["report", str(two_nodes)]) == 0
    assert "Restarts: 1" in capsys.readouterr().out


def test_plot_writes_a_png(two_nodes, tmp_path, capsys):
    require_tool("matplotlib", importlib.util.find_spec("matplotlib") is not None, "pip install 'elastic-rt[plot]'")
    png = tmp_path / "t.png"
    assert main(["report", str(two_nodes), "--plot", str(png)]) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000


def test_report_errors_are_one_line(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing")]) == 2
    assert main(["report", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and "no such file" in err[0] and "goodput-*.jsonl" in err[1]


def test_a_torn_last_line_is_skipped(two_nodes):
    path = next((two_nodes / "a").glob("goodput-*.jsonl"))
    with open(path, "a") as f:
        f.write('{"time": 1.7e9, "event": "tot')
    assert load([str(path)]).sessions[0].exited
