"""A worker whose script returned but whose interpreter then aborts is finished, not failed: the job is not
run again (torch 2.13 aborts in teardown now and then; torchrun fails the job then)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.harness import Node
from tests.chaos.test_launch_e2e import nodes  # noqa: F401 - fixture

pytestmark = pytest.mark.slow

SCRIPT = str(Path(__file__).parent / "scripts" / "abort_after_return.py")


def launch(nodes, tmp_path, *script_args: str) -> Node:  # noqa: F811
    n = Node(["--standalone", "--nproc-per-node", "2", "--max-restarts", "1", "--tee", "3",
              "--log-dir", str(tmp_path / "logs"), SCRIPT, *script_args], name="a")
    nodes.append(n)
    return n


def test_abort_after_the_script_returned_is_not_a_failure(nodes, tmp_path):  # noqa: F811
    n = launch(nodes, tmp_path, "--abort-at-exit", "1")
    assert n.wait_exit(180) == 0, n.output[-4000:]
    assert len(n.matches(r"done rank=\d restart=0 world_size=2")) == 2, n.output[-4000:]
    assert not n.matches(r"restart=1"), n.output[-4000:]  # the job ran once
    assert n.matches(r"worker local rank 1 \(pid \d+\) ended with SIGABRT after its script returned"), n.output[-4000:]
    assert not n.matches(r"restarting the worker group|worker failed"), n.output[-4000:]


def test_abort_before_the_script_returned_is_a_failure(nodes, tmp_path):  # noqa: F811
    n = launch(nodes, tmp_path, "--abort-before-return", "1")
    n.wait_for(r"worker failed: rank 1 \(local 1, pid \d+\) cause=signal: SIGABRT", 180)
    n.wait_for(r"done rank=\d restart=1 world_size=2", 180)  # restarted, and aborts again
    assert n.wait_exit(180) != 0, n.output[-4000:]
    assert not n.matches(r"local rank 1 \(pid \d+\) ended with .* after its script returned"), n.output[-4000:]
