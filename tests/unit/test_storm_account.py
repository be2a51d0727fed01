"""benchmarks/storm_job.py's account: steps kept after rollbacks, lost steps per failure, restores by tier, idle."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "benchmarks"))
from storm_job import account  # noqa: E402


def _steps(first: int, last: int, t: float, world: int = 6) -> list[tuple[float, str]]:
    return [(t + i, f"[default0]:step={s} loss=0.5 world_size={world}") for i, s in enumerate(range(first, last + 1))]


def _start(t: float, step: int, world: int, tier: str | None = None) -> tuple[float, str]:
    return (t, f"[default0]:start step={step} world_size={world} backend=gloo restart=0"
               + (f" restored_from={tier}" if tier else ""))


def test_a_worker_loss_rolls_back_to_the_restored_step_and_counts_its_lost_steps():
    lines = [_start(-1.0, 0, 6), *_steps(1, 10, 0.0), _start(12.0, 5, 6, "memory"), *_steps(6, 8, 13.0)]
    got = account(lines, [(9.5, "worker")], t0=0.0, end=20.0)
    assert got["steps_reached"] == 8  # the rollback to 5 counts: 6..8 were trained again
    assert got["lost_per_failure"] == [5]
    assert got["restores_by_tier"] == {"memory": 1}
    assert got["no_training_s"] == 4.0  # the last step before the restart (t=9) to the first after it (t=13)


def test_a_node_loss_restores_from_a_replica_then_grows_back_and_both_restarts_count_for_it():
    lines = [*_steps(1, 10, 0.0), _start(11.0, 10, 4, "memory"), *_steps(11, 12, 12.0, world=4),
             _start(20.0, 10, 6, "memory"), *_steps(11, 11, 21.0)]
    got = account(lines, [(10.5, "node")], t0=0.0, end=30.0)
    assert got["steps_reached"] == 11
    assert got["lost_per_failure"] == [2]  # 0 at the shrink, 2 at the grow
    assert got["restores_by_tier"] == {"replica": 1, "memory": 1}
    assert [r["world_size"] for r in got["restarts"]] == [4, 6]


def test_a_restart_still_under_way_at_the_end_is_idle_until_the_end_and_later_lines_do_not_count():
    lines = [*_steps(1, 5, 0.0), _start(8.0, 0, 6), *_steps(1, 3, 12.0)]
    got = account(lines, [(5.0, "worker")], t0=0.0, end=10.0)
    assert got["steps_reached"] == 0  # restored nothing (torchrun without a checkpoint): back to step 0
    assert got["restores_by_tier"] == {"none": 1}
    assert got["no_training_s"] == 6.0  # from the last step (t=4) to the end
    assert got["lost_per_failure"] == [5]


def test_a_job_down_at_the_end_keeps_only_its_newest_commit():
    lines = [_start(-1.0, 0, 6), *_steps(1, 10, 0.0), (5.5, "[default0]:checkpoint saved step=6 world_size=6 "
                                                          "blocked_s=0.0 save_s=0.1 tier=storage")]
    got = account(lines, [(9.5, "worker"), (12.0, "worker")], t0=0.0, end=15.0)
    assert got["steps_reached"] == 6  # step 10 was printed, but the restart still under way resumes from 6
    assert got["kills_without_restart"] == 2 and got["lost_per_failure"] == []
    assert got["no_training_s"] == 6.0  # the last step (t=9) to the end
