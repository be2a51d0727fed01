"""benchmarks/provenance.py on a scratch git repository: the commit, and dirty trees refused."""

from __future__ import annotations

import importlib.util
import os
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("provenance", REPO / "benchmarks" / "provenance.py")
provenance_mod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(provenance_mod)  # type: ignore[union-attr]
provenance = provenance_mod.provenance


def git(repo: Path, *args: str) -> str:
    return subprocess.run(["git", "-C", str(repo), *args], check=True, capture_output=True, text=True).stdout


@pytest.fixture
def checkout(tmp_path):
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@example.com")
    git(tmp_path, "config", "user.name", "t")
    (tmp_path / "bench.py").write_text("print(1)\n")
    git(tmp_path, "add", "bench.py")
    git(tmp_path, "commit", "-qm", "one")
    return tmp_path


def test_a_clean_tree_records_its_commit(checkout):
    head = git(checkout, "rev-parse", "HEAD").strip()
    assert provenance(False, repo=str(checkout)) == {"commit": head, "dirty": False, "allow_dirty": False,
                                                    "changes": []}


def test_a_dirty_tree_is_refused_in_one_line_unless_allowed(checkout):
    (checkout / "bench.py").write_text("print(2)\n")
    (checkout / "new.py").write_text("")
    with pytest.raises(SystemExit) as exc:
        provenance(False, repo=str(checkout))
    message = str(exc.value)
    assert "\n" not in message and "bench.py, new.py" in message and "--allow-dirty" in message
    recorded = provenance(True, repo=str(checkout))
    assert recorded["dirty"] and recorded["allow_dirty"] and recorded["changes"] == ["bench.py", "new.py"]


def test_results_being_written_do_not_make_the_tree_dirty(checkout):
    (checkout / "benchmarks" / "results").mkdir(parents=True)
    (checkout / "benchmarks" / "results" / "run.txt").write_text("")
    assert provenance(False, repo=str(checkout))["dirty"] is False


def test_outside_a_checkout_only_allow_dirty_runs(tmp_path):
    with pytest.raises(SystemExit, match="--allow-dirty"):
        provenance(False, repo=str(tmp_path))
    assert provenance(True, repo=str(tmp_path))["commit"] == "unknown"


def test_the_machine_record_names_the_cost_of_a_page_first_touched():
    speed = provenance_mod.machine_speed()
    assert set(speed) == {"cpu_model", "python_loop_2m_s", "page_fault_us"}
    # a first touch costs a fault and a page's zeroing: more than nothing, and well under a millisecond anywhere
    assert 0.0 < speed["page_fault_us"] < 1000.0
    assert 0.0 < provenance_mod.page_fault_us(pages=64, tries=1) < 1000.0


def test_the_disk_probe_times_durable_small_writes_and_leaves_nothing_behind(tmp_path):
    disk = provenance_mod.disk_fsync_ms(str(tmp_path), writes=20)
    assert set(disk) == {"p50_ms", "p99_ms", "dir"} and disk["dir"] == str(tmp_path)
    assert 0.0 <= disk["p50_ms"] <= disk["p99_ms"] < 60_000.0
    assert list(tmp_path.iterdir()) == []  # the probe's file is gone
    if os.path.isdir("/dev/shm"):  # tmpfs: fdatasync has nothing to wait for
        assert provenance_mod.disk_fsync_ms("/dev/shm", writes=20)["p50_ms"] < 1.0
