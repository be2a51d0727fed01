"""benchmarks/overhead.py --quick runs both launchers end to end and writes results that parse.

No timing is asserted: the benchmark holds the performance goals, this test only shows it works.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "overhead.py")


@pytest.mark.long  # for CI's time: a benchmark run whole (benchmarks/README.md runs it)
@pytest.mark.timeout(1500)  # two short trials; generous for a loaded machine
def test_quick_run_writes_both_launchers(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--allow-dirty", "--out", str(tmp_path),
                           "--startup-timeout", "600"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=1400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [json_name] = [n for n in os.listdir(tmp_path) if n.endswith(".json")]
    assert json_name.startswith("overhead-") and os.path.exists(tmp_path / json_name.replace(".json", ".txt"))
    with open(tmp_path / json_name) as f:
        result = json.load(f)
    assert result["provenance"]["allow_dirty"] is True and result["provenance"]["commit"]
    assert {s["launcher"] for s in result["summary"]} == {"torchrun", "elastic-rt"}
    for s in result["summary"]:
        assert s["ok"] == s["trials"] == 1, s
        assert s["steps_per_s_median"] > 0 and s["ratio_to_torchrun"] > 0
        assert s["agent_cpu_pct_median"] is not None and s["workers_cpu_ms_per_step_median"] > 0
        assert s["omp_num_threads"] == ["1"]  # both launchers default it for 2 workers per node
    assert {r["config"] for r in result["trials"]} == {"torchrun", "ert"}
    for r in result["trials"]:
        assert r["outcome"] == "ok" and r["exit_codes"] == [0], r


def test_refuses_a_dirty_tree_without_allow_dirty(tmp_path):
    """In a checkout with an uncommitted change the benchmark refuses to run (one line, exit != 0)."""
    src = tmp_path / "repo"
    (src / "benchmarks").mkdir(parents=True)
    for name in ("overhead.py", "provenance.py"):
        with open(os.path.join(REPO, "benchmarks", name)) as f:
            (src / "benchmarks" / name).write_text(f.read())
    bench = src / "benchmarks" / "overhead.py"
    git = ["git", "-c", "user.name=t", "-c", "user.email=t@t", "-C", str(src)]
    for cmd in (["init", "-q"], ["add", "-A"], ["commit", "-qm", "bench"]):
        subprocess.run(git + cmd, check=True, timeout=60)
    bench.write_text(bench.read_text() + "\n# local edit\n")
    proc = subprocess.run([sys.executable, str(bench), "--quick", "--out", str(tmp_path / "out")],
                          cwd=src, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "uncommitted changes" in proc.stderr and "--allow-dirty" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()
