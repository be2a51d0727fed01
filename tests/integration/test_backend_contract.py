"""RendezvousBackend contract: compare-and-set with a fencing token, run against every backend."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend

from elastic_rt.rendezvous.backend import EtcdV3RendezvousBackend
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig


class BackendContract:
    """Subclasses provide `backend` (fresh, empty state) and `make_backend_in_child` for races."""

    def test_empty_state_is_none(self, backend):
        assert backend.get_state() is None

    def test_create_only_when_token_is_none(self, backend):
        state, token, ok = backend.set_state(b"first")
        assert ok and state == b"first"
        state2, token2, ok2 = backend.set_state(b"second")
        assert not ok2
        assert state2 == b"first" and token2 == token

    def test_cas_with_current_token_wins(self, backend):
        _, token, _ = backend.set_state(b"a")
        state, token2, ok = backend.set_state(b"b", token)
        assert ok and state == b"b" and token2 != token
        assert backend.get_state() == (b"b", token2)

    def test_stale_token_returns_current_state(self, backend):
        _, t1, _ = backend.set_state(b"a")
        _, t2, _ = backend.set_state(b"b", t1)
        state, token, ok = backend.set_state(b"c", t1)  # t1 is stale now
        assert not ok
        assert (state, token) == (b"b", t2)

    def test_garbage_token_does_not_write(self, backend):
        backend.set_state(b"a")
        result = backend.set_state(b"z", "not-a-token")
        assert result is not None and result[0] == b"a" and result[2] is False

    def test_binary_state_round_trips(self, backend):
        blob = bytes(range(256)) * 4
        backend.set_state(blob)
        assert backend.get_state()[0] == blob


def _race_worker(make, idx, barrier, results):
    backend = make()
    barrier.wait()
    wins = 0
    for rnd in range(10):
        # every process tries to move the state from round rnd to rnd+1 exactly once
        while True:
            cur = backend.get_state()
            if cur is None:
                out = backend.set_state(b"0")
                if out[2]:
                    continue
                cur = out[:2]
            value, token = cur
            if int(value) > rnd:
                break
            out = backend.set_state(str(rnd + 1).encode(), token)
            if out[2]:
                wins += 1
                break
    results.put((idx, wins))


class TestEtcdV3Backend(BackendContract):
    @pytest.fixture
    def backend(self, etcd_client, run_id):
        return EtcdV3RendezvousBackend(etcd_client, run_id)

    def test_name(self, backend):
        assert backend.name == "etcd-v3"

    def test_processes_racing_exactly_one_wins_per_round(self, etcd_server, run_id):
        m = etcd_server.members[0]
        ctx = mp.get_context("spawn")
        barrier, results = ctx.Barrier(4), ctx.Queue()
        procs = [ctx.Process(target=_race_worker, args=(_Maker(m.host, m.client_port, run_id), i, barrier, results))
                 for i in range(4)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
            assert p.exitcode == 0
        wins = dict(results.get(timeout=5) for _ in procs)
        assert sum(wins.values()) == 10  # ten rounds, one winner each


class _Maker:
    def __init__(self, host, port, run_id):
        self.host, self.port, self.run_id = host, port, run_id

    def __call__(self):
        return EtcdV3RendezvousBackend(EtcdClient(EtcdConfig(endpoints=((self.host, self.port),))), self.run_id)


class TestTorchC10dBackend(BackendContract):
    """The reference implementation passes the same contract."""

    @pytest.fixture
    def backend(self, run_id):
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
        return C10dRendezvousBackend(store, run_id)

    def test_garbage_token_does_not_write(self, backend):
        backend.set_state(b"a")
        result = backend.set_state(b"z", "not-a-token")
        assert result is not None and result[2] is False
