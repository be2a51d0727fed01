"""benchmarks/recovery.py's failure-model scenarios run end to end (one short scenario) and their arithmetic holds.

No timing is asserted: the benchmark holds the performance goals, this test only shows it works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "recovery.py")


@pytest.fixture
def failure_scenarios():
    sys.path.insert(0, os.path.dirname(BENCH))
    try:
        import recovery  # the entry point, which imports failure_scenarios

        yield recovery.failure_scenarios
    finally:
        sys.path.remove(os.path.dirname(BENCH))


def test_progress_counts_only_steps_beyond_the_highest_seen(failure_scenarios):
    # steps 1-4, a restart without a checkpoint redoes 1-3, then 4 (redone) and 5, 6 are new... 5 and 6 only
    steps = [(1.0, 1), (2.0, 2), (3.0, 3), (4.0, 4), (5.0, 1), (6.0, 2), (7.0, 3), (8.0, 4), (9.0, 5), (10.0, 6)]
    assert failure_scenarios.progress(steps, 0.0, 4.0) == 4
    assert failure_scenarios.progress(steps, 4.0, 10.0) == 2
    assert failure_scenarios.progress(steps, 2.5, 3.5) == 1


@pytest.mark.timeout(900)  # one short trial; generous for a loaded machine
def test_hang_scenario_runs_and_writes_its_figures(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")])))
    out = tmp_path / "recovery.json"
    proc = subprocess.run([sys.executable, BENCH, "--scenarios", "hang/ert", "--trials", "1", "--allow-dirty",
                           "--startup-timeout", "600", "--json", str(out)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=850)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    [row] = result["rows"]
    assert row["scenario"] == "hang/ert" and row["trials"] == 1
    [trial] = row["results"]
    assert trial["outcome"] == "recovered", trial
    assert trial["reasons"] == ["hang"]
    assert trial["extra"]["beyond_timeout_s"] == pytest.approx(trial["detect_s"] - 5.0)
    assert row["median_beyond_timeout_s"] is not None
    assert any(t["target"].startswith("hang:") for t in result["targets"])
    assert "detected" in proc.stdout and "beyond --hang-timeout 5" in proc.stdout
