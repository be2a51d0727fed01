"""The pre-flight tests' child processes for real: the compute test, one child per local rank (one of
them on a device that does not exist), and the ring link test across three processes on a TCPStore."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from etcd_testbed.server import free_port
from elastic_rt.collectors.probe import spawn_probe
from elastic_rt.doctor import bench
from elastic_rt.errors import HealthCheckError


def test_compute_children_run_at_once_and_the_one_that_failed_is_named():
    # (the results of children that succeed are read in the pre-flight end-to-end test)
    with pytest.raises(HealthCheckError, match=r"local rank 1 \(nodev:0\)") as err:
        bench.run_local(["cpu", "nodev:0"], seconds=0.2, timeout_s=180)
    assert "local rank 0" not in str(err.value)


def test_ring_test_across_three_processes_times_every_link():
    port = free_port()
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(spawn_probe, master_addr="127.0.0.1", master_port=port, rank=r, world_size=3,
                               nbytes=1 << 20, timeout_s=60, backend="gloo", ring=True, nice=0) for r in range(3)]
        links = [f.result() for f in futures]
    assert all(isinstance(s, float) and s > 0 for s in links)  # the data check ran in each (rank from rank - 1)


def test_ring_test_without_its_peers_fails_in_one_line():
    with pytest.raises(HealthCheckError, match=r"^ring test \(gloo, 2 nodes, 1024 bytes\) failed: "):
        spawn_probe(master_addr="127.0.0.1", master_port=free_port(), rank=0, world_size=2, nbytes=1024,
                    timeout_s=3, backend="gloo", ring=True, nice=0)
