"""launch/train_example.py under the plan: a checkpoint saved with another global batch size is refused with one line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

from tests.chaos.harness import EXAMPLE, ROOT


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def example(*args: str) -> subprocess.CompletedProcess:
    """The example as one worker of a world of 1 (torch's env:// rendezvous, no launcher)."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_port()), OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, EXAMPLE, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)


def test_checkpoint_of_another_global_batch_is_refused_with_one_line(tmp_path) -> None:
    job = ["--dataset-size", "40", "--ckpt-url", f"file://{tmp_path}/ck", "--save-every", "3"]
    first = example(*job, "--global-batch-size", "4", "--micro-batch-size", "2", "--steps", "3")
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert "step=3 loss=" in first.stdout and "checkpoint saved step=3 " in first.stdout

    resumed = example(*job, "--global-batch-size", "8", "--steps", "6")
    assert resumed.returncode == 2, resumed.stdout[-2000:] + resumed.stderr[-2000:]
    errors = [line for line in resumed.stderr.splitlines() if "error" in line.lower()]
    assert errors == [
        "train_example.py: error: the checkpoint is at optimizer step 3 but its sampler state (epoch 0, "
        "12 of 40 samples consumed) is step 2 at a global batch of 8; restore with the global batch "
        "size it was saved with"
    ]
    assert "Traceback" not in resumed.stderr
    assert "step=4" not in resumed.stdout  # nothing was trained on the refused state
