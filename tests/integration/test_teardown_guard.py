"""The worker entry point's guard against torch's gloo destructor deadlock (see teardown_guard.py).

The deadlock itself is a race between a gloo worker thread and the thread that
drops the last reference to the group, so no test can force it on demand. What
these tests pin down is the property that removes it: after
`destroy_process_group()` in a worker started by elastic-rt, no DDP Reducer of a
destroyed group is left, whichever way the groups are destroyed.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from etcd_testbed.server import free_port

SCRIPT = textwrap.dedent("""
    import gc, sys
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def released(m):
        return m.reducer is None and "logger" not in m.__dict__

    def train(mode):
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
        ddp = DDP(nn.Linear(4, 4))
        for _ in range(2):
            ddp(torch.ones(2, 4)).sum().backward()
            flag = torch.zeros(1)
            dist.all_reduce(flag)
        sub = dist.new_group([0])
        ddp_sub = DDP(nn.Linear(4, 4), process_group=sub)
        if mode == "subgroup-first":
            dist.destroy_process_group(sub)
            print("after subgroup", released(ddp_sub), released(ddp), flush=True)
            dist.destroy_process_group()
        elif mode == "world-explicit":  # torch destroys every group for the default group too
            dist.destroy_process_group(dist.group.WORLD)
        elif mode == "frozen":  # modules in gc's permanent generation are found as well
            gc.freeze()
            dist.destroy_process_group()
        print("after all", released(ddp_sub), released(ddp), flush=True)

    train(sys.argv[2])  # the DDP modules are freed here, as in a real script
    print("exited", flush=True)
""")


def _run(tmp_path, mode: str, env_extra: dict) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "elastic_rt.worker.main", "--", str(script), str(free_port()), mode],
        capture_output=True, text=True, timeout=120, env=env,
    )


@pytest.mark.parametrize("mode", ["subgroup-first", "world-explicit", "frozen"])
def test_destroying_groups_releases_their_ddp_reducers(tmp_path, mode):
    out = _run(tmp_path, mode, {})
    assert out.returncode == 0, out.stderr[-3000:]
    if mode == "subgroup-first":  # a subgroup's destroy releases only its own modules
        assert "after subgroup True False" in out.stdout
    assert "after all True True" in out.stdout
    assert "exited" in out.stdout


def test_guard_can_be_turned_off(tmp_path):
    out = _run(tmp_path, "subgroup-first", {"ELASTIC_RT_NO_TEARDOWN_GUARD": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "after subgroup False False" in out.stdout  # torch's own behaviour: Reducers keep their groups
    assert "after all False False" in out.stdout
