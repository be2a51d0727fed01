"""benchmarks/rendezvous_scale.py --quick runs etcd-v3 and c10d at N = 8 and 16 and writes results that parse.

No timing is asserted: the benchmark holds the performance goals (1,024 nodes meet in < 10 s,
re-form in < 5 s), this test only shows it works end to end against a real 3-member etcd.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(REPO, "benchmarks", "rendezvous_scale.py")


def _bench():
    """The benchmark script as a module (it is not in a package)."""
    sys.path.insert(0, os.path.dirname(BENCH))
    try:
        import rendezvous_scale
    finally:
        sys.path.remove(os.path.dirname(BENCH))
    return rendezvous_scale


@pytest.mark.long  # for CI's time: a benchmark run whole (benchmarks/README.md runs it)
@pytest.mark.timeout(600)  # about 30 s; generous for a loaded machine
def test_quick_run_writes_results_that_parse(tmp_path):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--allow-dirty", "--out", str(tmp_path)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    [json_name] = [n for n in os.listdir(tmp_path) if n.endswith(".json")]
    assert json_name.startswith("rendezvous-scale-")
    with open(tmp_path / json_name.replace(".json", ".txt")) as f:
        text = f.read()
    assert "| 16 | etcd-v3 |" in text and "| 16 | c10d |" in text, text
    with open(tmp_path / json_name) as f:
        result = json.load(f)
    assert result["provenance"]["allow_dirty"] is True and result["provenance"]["commit"]
    assert result["settings"]["rdzv_conf"] == {}  # the handler's defaults (lease_ttl=3)
    assert "with a GIL switch interval of 50 ms" in text
    etcd = result["etcd"]  # which etcd the run used, as its members report it
    assert etcd["members"] == 3 and len(etcd["member_versions"]) == 3 and etcd["version"][:2] == "3."
    assert os.path.isfile(etcd["binary"]) and f"etcd {etcd['version']} (3 members" in text
    disk = etcd["data_fsync"]  # the disk under etcd's data, timed before the run
    assert 0.0 <= disk["p50_ms"] <= disk["p99_ms"] and f"data in {disk['dir']}, whose fdatasync took" in text
    assert len(result["host"]["loadavg_at_start"]) == 3
    rows = {(r["kind"], r["n"]): r for r in result["rows"]}
    assert set(rows) == {(k, n) for k in ("etcd-v3", "c10d") for n in (8, 16)}
    for (kind, n), r in rows.items():
        assert r["error"] == "" and r["meet_s"] > 0, r
        assert len(r["loadavg_before"]) == len(r["loadavg_after"]) == 3
        assert r["worker_switch_interval_s"] == [pytest.approx(0.05)], r  # what every worker process runs with
        assert r["meet_host"]["ctx_switches_per_s"] > 0 and 0 < r["meet_host"]["kernel_cpu_share"] < 1, r
    for n in (8, 16):
        r = rows[("etcd-v3", n)]
        assert r["reform_s"] > 0 and r["req_per_node_round"] > 0 and r["bytes_per_node_round"] > 0, r
        assert set(r["idle"]["requests"]) <= {"LeaseKeepAlive"}, r["idle"]  # watched, not polled
        assert r["ticks_per_node_s"] > 0
        assert r["client_cpu_ms_per_node_round"] > 0, r
        # idle: a few keep-alives per node in the window, below the processes' CPU clock tick at 8 nodes
        assert r["idle_client_cpu_ms_per_node_s"] >= 0, r
        assert r["reform_cpu_s"]["clients"] > 0 and r["reform_cpu_s"]["etcd"] > 0, r
        assert r["settle_req_per_node_s"] >= 0 and r["idle_wall_s"] >= 2.0, r
        assert r["settled_before_loss_s"] >= 0, r  # one round of all N before the loss
        sample = r["settled_sample"]  # what the first node's handler knew then (_detail)
        assert sample["state"] == "ticking" and sample["reachable"] is True and "detail_error" not in sample, sample
        assert sample["view_round"] == sample["membership_round"] and sample["view_connected"] is True, sample
        assert r["round"]["leader_changes"] >= 0 and 0 <= r["meet_host"]["steal_cpu_share"] < 1, r
        assert 0 <= r["reform_host"]["steal_cpu_share"] < 1, r
        assert r["round"]["fsync"]["count"] >= 0 and set(r["reform_round"]["fsync"]) == {"count", "mean_ms", "p99_ms"}
        for phase in ("meet_lease_lapses", "reform_lease_lapses"):  # whose silence each lapse was (none expected)
            assert set(r[phase]) == {*_bench()._causes(), "silence_s", "unrenewed_s", "first_s", "by_member",
                                     "by_keepalive_member"}, r[phase]
        assert r["meet_keepalive_busy"] >= 0 and r["reform_keepalive_busy"] >= 0 and r["round"]["slow_applies"] >= 0
        assert r["meet_rejoined"] == 0, r  # every node met in its first rendezvous
        assert rows[("c10d", n)]["reform_s"] is None  # --quick skips torch's 45 s re-form


def test_handlers_per_process_are_bounded_unless_procs_is_given():
    bench = _bench()
    args = bench.parse_args([])
    assert args.procs == 0 and args.per_proc == 32
    assert [bench.procs_for(n, args) for n in (4, 8, 256, 512, 1024, 2048)] == [4, 8, 8, 16, 32, 64]
    args = bench.parse_args(["--procs", "8"])
    assert [bench.procs_for(n, args) for n in (4, 1024)] == [4, 8]


def test_switch_interval_option():
    bench = _bench()
    assert bench.parse_args([]).switch_interval_ms == 50.0
    assert bench.parse_args(["--switch-interval-ms", "5"]).switch_interval_ms == 5.0
    with pytest.raises(SystemExit):
        bench.parse_args(["--switch-interval-ms", "0"])


def test_etcd_options(tmp_path, capsys):
    bench = _bench()
    args = bench.parse_args([])
    assert args.etcd_binary is None and args.etcd_members == 3 and args.rdzv_conf == {}
    with pytest.raises(SystemExit):
        bench.parse_args(["--etcd-binary", str(tmp_path / "no-etcd")])
    assert "is not an executable file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--etcd-members", "0"])
    assert (args.cpus, args.client_nice, args.etcd_data_dir) == (0.0, 0, None)
    with pytest.raises(SystemExit):
        bench.parse_args(["--etcd-data-dir", str(tmp_path / "none")])
    assert bench.parse_args(["--etcd-data-dir", str(tmp_path)]).etcd_data_dir == str(tmp_path)
    with pytest.raises(SystemExit):
        bench.parse_args(["--cpus", "-1"])
    assert args.etcd_write_iops == 0
    with pytest.raises(SystemExit):
        bench.parse_args(["--etcd-write-iops", "-1"])
    if os.path.isdir("/dev/shm"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--etcd-write-iops", "100", "--etcd-data-dir", "/dev/shm"])
        assert "--etcd-write-iops: " in capsys.readouterr().err


def test_etcds_writes_are_throttled_where_asked_and_counted():
    """--etcd-write-iops: a real 3-member etcd whose members fsync their WAL (3.5 too) and start in the write
    throttle's cgroup, the writes they make counted there, and the cgroup gone with the cluster."""
    import tempfile

    from elastic_rt.chaos import io_throttle
    from elastic_rt.rendezvous.etcd_client import EtcdClient

    if (why := io_throttle.available(tempfile.gettempdir())) is not None:
        pytest.skip(f"no write throttle here: {why}")
    bench = _bench()
    args = bench.parse_args(["--etcd-write-iops", "200"])
    assert args.etcd_write_iops == 200
    with bench._etcd_cluster(args) as (cluster, throttle):
        assert cluster.fsyncs and bench.etcd_facts(cluster)["wal_fsync"]
        assert sorted(throttle.pids()) == sorted(m.proc.pid for m in cluster.members)
        before = throttle.writes()
        etcd = EtcdClient(cluster.client_config())
        try:
            for i in range(20):
                etcd.put(f"/throttled/{i}", b"x")
        finally:
            etcd.close()
        assert throttle.writes() > before, "the members' WAL writes were not counted in the throttle's cgroup"
        assert bench._throttle_note({"write_iops": 200, "write_iops_disk": throttle.disk, "writes": 7}) == (
            f"etcd's writes limited to 200 a second on disk {throttle.disk} (7 writes made), ")
        path, root = throttle.path, cluster.root
    assert not os.path.exists(path) and not os.path.exists(root)
    with bench._etcd_cluster(bench.parse_args([])) as (cluster, throttle):
        assert throttle is None and cluster.wrap is None


def test_the_leader_is_moved_where_asked_and_recorded_from_etcds_metrics():
    """--leader first|other moves etcd's leadership to member 0 (which every handler talks to first) or to another
    one before a run; the run records the leader from the members' own is_leader gauge."""
    from etcd_testbed.server import EtcdCluster

    bench = _bench()
    assert bench.parse_args([]).leader == "any" and bench.parse_args(["--leader", "other"]).leader == "other"
    with EtcdCluster(3) as cluster:
        for index in (2, 0, 1):
            cluster.move_leader(index)
            assert cluster.leader_index() == index and bench.etcd_metrics(cluster)["leader"] == index


def test_reform_lapses_spare_the_closer_and_the_lost_node(tmp_path):
    bench = _bench()
    assert bench.parse_args([]).reform_lapses == 0 and not bench.parse_args([]).lose_smallest
    assert bench.parse_args(["--lose-smallest"]).lose_smallest
    with pytest.raises(SystemExit):
        bench.parse_args(["--reform-lapses", "-1"])
    names = [f"n{i:04d}" for i in range(1024)]
    picked = bench.lapsing(names, 64)
    assert len(set(picked)) == 64 and "n0000" not in picked and "n1023" not in picked
    assert picked[0] == "n0001" and picked[-1] > "n0900"  # spread over the ring, not one neighbourhood
    assert bench.lapsing(names[:3], 5) == ["n0001"] and bench.lapsing(names[:2], 1) == [] and bench.lapsing(names, 0) == []


def test_the_reform_is_the_first_rendezvous_begun_after_the_loss():
    """A node that restarted before the loss (a lease that lapsed in the meeting, a round again of all N) has more
    than one rendezvous by then: the re-form reported is the one begun after the loss, not its second one."""
    bench = _bench()
    steady, restarted, late = bench.Node("a", None), bench.Node("b", None), bench.Node("c", None)
    steady.done = [{"t0": 1.0, "t": 2.0, "world": 4}, {"t0": 10.5, "t": 11.0, "world": 3}]
    restarted.done = [{"t0": 1.0, "t": 2.0, "world": 4}, {"t0": 5.0, "t": 6.0, "world": 4},
                      {"t0": 10.2, "t": 11.5, "world": 3}]
    late.done = [{"t0": 1.0, "t": 2.0, "world": 4}]
    rows = bench._report_after([steady, restarted, late], 10.0)
    assert [(r["node"], r["before"], r.get("world"), r.get("error")) for r in rows] == [
        ("a", 1, 3, None), ("b", 2, 3, None), ("c", 1, None, "timeout")]
    assert bench._met([rows[:2]], 10.0, 3) == (1.5, "")
    assert bench._lapse_note({"restarted_before_loss": 1}) == "1 nodes restarted before the loss; "
    # a node that did not meet says what it was doing: here, nothing begun since its rendezvous of world 4
    assert bench._met([rows], 10.0, 3) == (
        None, "1 of 3 nodes (c): timeout (new, 1 rendezvous, the last of world 4)")
    late.state, late.done = "ticking", late.done + [{"t0": 7.0, "t": 9.0, "error": "RendezvousTimeoutError: x"}]
    assert bench._met([bench._report_after([late], 10.0)], 10.0, 3)[1] == (
        "1 of 1 nodes (c): timeout (ticking, 2 rendezvous, the last failed: RendezvousTimeoutError: x)")


def test_a_run_says_what_the_host_and_etcd_did_to_it():
    """Lease grants beyond one per node, leader changes and CPU stolen by the host are named in the run's note: the
    causes to rule out before a slow run is taken for the code's."""
    bench = _bench()
    calm = {"n": 4, "round": {"requests": {"LeaseGrant": 5.0}, "leader_changes": 0.0},
            "meet_host": {"steal_cpu_share": 0.01}}
    assert bench._lapse_note(calm) == ""
    rough = {"n": 4, "round": {"requests": {"LeaseGrant": 9.0}, "leader_changes": 3.0},
             "reform_round": {"leader_changes": 0.0}, "meet_host": {"steal_cpu_share": 0.2},
             "meet_lease_lapses": {"process": 3, "held": 2, "etcd": 1},
             "reform_lease_lapses": {"process": 0, "held": 0, "etcd": 0}}
    assert bench._lapse_note(rough) == ("9 lease grants in the meeting; 3 leader changes seen in the meeting; "
                                        "leases lapsed in the meeting: 3 with no keep-alive sent for a TTL (process "
                                        "not run), 2 (lease thread held), 0 (backing off), 0 (unexplained), 1 sent and "
                                        "not renewed; "
                                        "20% of the CPU stolen by the host in the meeting; ")


def test_wal_fsyncs_of_a_window_are_counted_and_a_slow_disk_is_named():
    bench = _bench()
    before = {"count": 10.0, "sum": 0.01, "buckets": {0.001: 10.0, 0.002: 10.0, 0.004: 10.0, 0.008: 10.0, 1.0: 10.0}}
    after = {"count": 110.0, "sum": 2.01, "buckets": {0.001: 10.0, 0.002: 10.0, 0.004: 40.0, 0.008: 108.0, 1.0: 110.0}}
    assert bench.fsync_delta(after, before) == {"count": 100, "mean_ms": 20.0, "p99_ms": 1000.0}
    assert bench.fsync_delta(before, before) == {"count": 0, "mean_ms": None, "p99_ms": None}
    slow = {"n": 4, "round": {"requests": {"LeaseGrant": 5.0}, "fsync": {"count": 100, "mean_ms": 20.0, "p99_ms": 64.0}}}
    assert bench._lapse_note(slow) == "WAL fsyncs of 20 ms on average in the meeting (p99 64.0 ms); "


def test_lease_lapses_are_counted_by_whose_silence_in_their_window():
    bench = _bench()
    lapses = [(10.5, "process", 3.4, 3.6, 2, 1), (11.0, "etcd", 1.0, 3.2, 0, None), (12.0, "held", 5.0, 5.1, 2, 1),
              (30.0, "etcd", 1, 4, 1, 1)]
    assert bench.lapse_summary(lapses, 10.0, 20.0) == {"process": 1, "held": 1, "backoff": 0, "unexplained": 0, "etcd": 1,
                                                       "silence_s": [1.0, 3.4, 5.0],
                                                       "unrenewed_s": [3.2, 3.6, 5.1], "first_s": 0.5,
                                                       "by_member": {"0": 1, "2": 2},
                                                       "by_keepalive_member": {"1": 2, "None": 1}}
    assert bench.lapse_summary(lapses, 40.0, 50.0) == {"process": 0, "held": 0, "backoff": 0, "unexplained": 0, "etcd": 0,
                                                       "silence_s": [],
                                                       "unrenewed_s": [], "first_s": None, "by_member": {},
                                                       "by_keepalive_member": {}}


def test_the_nodes_that_did_not_settle_are_the_ones_outside_the_largest_group():
    bench = _bench()
    group = [{"node": f"n{i}", "world": 3, "round": 2} for i in range(3)]
    odd = {"node": "n3", "world": 4, "round": 1, "detail": {"state": "rejoining"}}
    assert bench._unsettled([group[:2], [group[2], odd]]) == [odd]
    assert bench._unsettled([group]) == []


def test_a_node_left_out_of_the_first_round_is_met_by_the_members_next_round(run_id):
    """The meeting as the benchmark runs it: the agents' monitor loops tick from the first round on, so the members of a
    round that left a node out (two of 2:3 met before the third asked) see it wait (SCALE_UP) and meet again, as real
    agents do; the meeting ends when every node's last rendezvous is a group of all N in one round."""
    import threading

    from etcd_testbed.server import EtcdCluster
    from torch.distributed.elastic.rendezvous import rendezvous_handler_registry

    from elastic_rt.rendezvous.registration import register

    bench = _bench()
    register()
    with EtcdCluster(1) as cluster:
        args = {"conf": {"last_call_timeout": "0.5"}, "etcd_endpoints": cluster.endpoints, "run_id": run_id}
        nodes = [bench.Node(f"n{i}", rendezvous_handler_registry.create_handler(
            bench._params("etcd-v3", f"n{i}", i, 3, args))) for i in range(3)]
        stop, counts = threading.Event(), {"ticks": 0}
        try:
            t0 = time.monotonic()
            for x in nodes[:2]:
                threading.Thread(target=x.rendezvous, daemon=True).start()
            bench._start_ticking(nodes, "etcd-v3", stop, counts)
            bench._start_ticking(nodes, "etcd-v3", stop, counts)  # once per process, however often asked
            bench._wait_world(nodes[:2], 2, time.monotonic() + 60)
            assert [x.done[-1].get("world") for x in nodes[:2]] == [2, 2]
            threading.Thread(target=nodes[2].rendezvous, daemon=True).start()
            bench._wait_world(nodes, 3, time.monotonic() + 60)
            rows = bench._report_met(nodes)
            assert bench._met([rows], t0, 3)[0] is not None, rows
            assert [len(x.done) for x in nodes] == [2, 2, 1], [x.done for x in nodes]
            assert [r["rendezvous"] for r in rows] == [2, 2, 1], rows  # what meet_rejoined counts
            assert sum(1 for t in threading.enumerate() if "(_tick)" in t.name) == 1  # one monitor loop
        finally:
            stop.set()
            bench._close(nodes, "etcd-v3")
