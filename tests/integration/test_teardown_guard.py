"""The worker entry point's guard against torch's gloo destructor deadlock (see teardown_guard.py).

The deadlock itself is a race between a gloo worker thread and the thread that
drops the last reference to the group, so no test can force it on demand. What
these tests pin down is the property that removes it: after
`destroy_process_group()` in a worker started by elastic-rt, no DDP Reducer
still holds the group, and a script that drops its DDP module afterwards exits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from elastic_rt.chaos.etcd_server import free_port

SCRIPT = textwrap.dedent("""
    import os, sys
    import torch, torch.distributed as dist, torch.nn as nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    def train():
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:" + sys.argv[1], rank=0, world_size=1)
        ddp = DDP(nn.Linear(4, 4))
        for _ in range(2):
            ddp(torch.ones(2, 4)).sum().backward()
            flag = torch.zeros(1)
            dist.all_reduce(flag)
        sub = dist.new_group([0])
        ddp_sub = DDP(nn.Linear(4, 4), process_group=sub)
        dist.destroy_process_group(sub)
        print("subgroup", ddp_sub.reducer is None, ddp.reducer is None, flush=True)
        dist.destroy_process_group()
        print("reducer_released", ddp.reducer is None and "logger" not in ddp.__dict__, flush=True)

    train()  # the DDP module is freed here, as in a real script
    print("exited", flush=True)
""")


def _run(tmp_path, env_extra: dict) -> subprocess.CompletedProcess:
    script = tmp_path / "job.py"
    script.write_text(SCRIPT)
    env = dict(os.environ, **env_extra)
    return subprocess.run(
        [sys.executable, "-m", "elastic_rt.agent.worker_main", "--", str(script), str(free_port())],
        capture_output=True, text=True, timeout=120, env=env,
    )


def test_worker_entry_point_releases_ddp_reducers_before_destroying_the_group(tmp_path):
    out = _run(tmp_path, {})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "subgroup True False" in out.stdout  # destroying a subgroup releases only its modules
    assert "reducer_released True" in out.stdout
    assert "exited" in out.stdout
    assert "Warning" not in out.stderr  # the object scan touches no deprecated torch attributes


def test_guard_can_be_turned_off(tmp_path):
    out = _run(tmp_path, {"ELASTIC_RT_NO_TEARDOWN_GUARD": "1"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert "subgroup False False" in out.stdout
    assert "reducer_released False" in out.stdout  # torch's own behaviour: the Reducer keeps the group
