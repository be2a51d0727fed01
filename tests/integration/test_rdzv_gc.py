"""What a run leaves in etcd, with real etcd and real handlers: the last agent of a finished run removes every key
but the `closed` marker, which its lease removes later; `elastic-rt gc` removes runs that ended or whose agents
are all gone, and never touches a live one."""

from __future__ import annotations

import contextlib
import io
import json
import time

from torch.distributed.elastic.rendezvous import RendezvousParameters

from elastic_rt.cli import main
from elastic_rt.rendezvous.claim import JobFingerprint
from elastic_rt.rendezvous.registration import create_etcd_v3_handler
from tests.integration.test_rdzv_trust import _together

JOB = JobFingerprint.of(script="train.py", script_args=(), min_nodes=2, max_nodes=2).encode()


def _handler(endpoint, run_id, node, lo=2, hi=2, **conf):
    conf.setdefault("last_call_timeout", 2)
    return create_etcd_v3_handler(RendezvousParameters("etcd-v3", endpoint, run_id, lo, hi, local_addr="127.0.0.1",
                                                       node_id=node, fingerprint=JOB, **conf))


def _keys(client, run_id: str) -> list:
    return client.list_prefix(f"/elastic-rt/{run_id}/", keys_only=True)[0]


def _poll(fn, timeout_s: float = 30.0):
    deadline = time.monotonic() + timeout_s
    while not (value := fn()) and time.monotonic() < deadline:
        time.sleep(0.1)
    return value


def _run_a_job(endpoint, run_id, *, finish: bool, tidy: bool, **conf) -> None:
    """Two agents form a round and write a store key (on the run's lease); the job finishes (closed) or not; both
    leave, each tidying (the last one removes the run) when `tidy`."""
    a, b = (_handler(endpoint, run_id, n, **conf) for n in "ab")
    try:
        _together([a, b])
        store = a._rounds.keys.round_store(a.membership.round)
        a._client.put(store + "worker-key", b"v", lease=a._run_lease.lease_id)
        if finish:
            a.set_closed()
    finally:
        for h in (a, b):
            h.leave()
            if tidy:
                h.tidy()
            h.close()


def test_a_finished_run_leaves_only_its_closed_marker_then_nothing(etcd_endpoint, etcd_client, run_id):
    _run_a_job(etcd_endpoint, run_id, finish=True, tidy=True, closed_ttl=2)
    left = _keys(etcd_client, run_id)
    assert [kv.key for kv in left] == [f"/elastic-rt/{run_id}/closed"] and left[0].lease != 0
    assert _poll(lambda: not _keys(etcd_client, run_id)), "the closed marker outlived its lease"


def test_the_first_agent_to_leave_removes_nothing(etcd_endpoint, etcd_client, run_id):
    a, b = (_handler(etcd_endpoint, run_id, n) for n in "ab")
    try:
        _together([a, b])
        a.set_closed()
        a.leave()
        assert a.tidy() == 0  # b is still registered: its run stays whole
        assert f"/elastic-rt/{run_id}/round" in {kv.key for kv in _keys(etcd_client, run_id)}
    finally:
        for h in (a, b):
            h.leave()
            h.close()


def _gc(endpoint, *args) -> tuple[int, list[dict]]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(["gc", "--rdzv-endpoint", endpoint, "--json", *args])
    return code, [json.loads(line) for line in out.getvalue().splitlines() if line.strip()]


def test_gc_removes_finished_and_abandoned_runs_and_keeps_live_ones(etcd_endpoint, etcd_client, run_id, capsys):
    finished, abandoned, live, torch_run = (f"{run_id}-{k}" for k in ("fin", "aba", "live", "torch"))
    _run_a_job(etcd_endpoint, finished, finish=True, tidy=False)  # its agents were killed before they tidied
    _run_a_job(etcd_endpoint, abandoned, finish=False, tidy=False)
    etcd_client.put(f"/elastic-rt/{torch_run}/state", b"pickled")
    keeper = _handler(etcd_endpoint, live, "a", 1, 1)
    try:
        keeper.next_rendezvous()
        before = {r: len(_keys(etcd_client, r)) for r in (finished, abandoned, live, torch_run)}

        code, dry = _gc(etcd_endpoint, "--dry-run")
        assert code == 0
        states = {e["run_id"]: e["state"] for e in dry}
        assert {r: states[r] for r in before} == {finished: "finished", abandoned: "abandoned", live: "live",
                                                  torch_run: "not judged"}
        assert {r: len(_keys(etcd_client, r)) for r in before} == before  # a dry run removes nothing

        # a named live run is refused in one line, and nothing is removed
        assert main(["gc", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", live, "--rdzv-id", finished]) == 2
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith("elastic-rt gc: error: run ") and "never touches a live run" in line, line
        assert {r: len(_keys(etcd_client, r)) for r in before} == before

        code, done = _gc(etcd_endpoint)
        assert code == 0
        removed = {e["run_id"]: e["removed"] for e in done}
        assert removed[finished] == before[finished] - 1 and removed[abandoned] == before[abandoned]
        assert [kv.key for kv in _keys(etcd_client, finished)] == [f"/elastic-rt/{finished}/closed"]
        assert _keys(etcd_client, abandoned) == []
        assert len(_keys(etcd_client, live)) == before[live] and len(_keys(etcd_client, torch_run)) == 1
        assert keeper.membership_change() is None  # the live run goes on
        assert main(["gc", "--rdzv-endpoint", etcd_endpoint, "--rdzv-id", "no-such-run"]) == 3
        code, again = _gc(etcd_endpoint, "--rdzv-id", finished)  # only its marker is left: nothing to do
        assert code == 0 and again[0]["removed"] == 0 and again[0]["note"].startswith("its closed marker stays")
    finally:
        keeper.leave()
        keeper.close()
