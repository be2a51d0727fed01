"""RendezvousBackend contract: torch's backend test cases, in our words, against every backend.

The cases follow torch 2.13's rendezvous backend test mixin
(test/distributed/elastic/rendezvous/rendezvous_backend_test.py). torch's own c10d backend
runs them too, as the reference; elastic-rt's etcd v3 backend runs them unsigned and signed
(`--rdzv-conf secret_file`). Cases about the envelope elastic-rt puts around torch's bytes
follow, for the etcd backend only.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable

import pytest
import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousStateError
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import (
    RendezvousBackend,
    RendezvousSettings,
    RendezvousTimeout,
    _BackendRendezvousStateHolder,
    _NodeDesc,
)

from elastic_rt.rendezvous.backend import MAGIC, EtcdV3RendezvousBackend, StateEnvelope
from elastic_rt.rendezvous.etcd_client import EtcdClient, EtcdConfig

SECRET = b"job-secret-0123456789abcdef"


@dataclass
class Impl:
    backend: RendezvousBackend
    corrupt: Callable[[], None]  # puts bytes the backend did not write where it keeps the state


@pytest.fixture(params=["etcd-v3", "etcd-v3-signed", "c10d"])
def impl(request, etcd_client, run_id) -> Impl:
    if request.param == "c10d":
        store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
        return Impl(C10dRendezvousBackend(store, run_id),
                    lambda: store.set("torch.rendezvous." + run_id, "non_base64"))
    backend = EtcdV3RendezvousBackend(etcd_client, run_id,
                                      secret=SECRET if request.param == "etcd-v3-signed" else None)
    return Impl(backend, lambda: etcd_client.put(backend.key, b"non_base64"))


def _holder(backend) -> _BackendRendezvousStateHolder:
    """torch's own state holder: what DynamicRendezvousHandler syncs (and unpickles) through."""
    settings = RendezvousSettings("run", 1, 2, RendezvousTimeout(), timedelta(seconds=5), 3)
    return _BackendRendezvousStateHolder(backend, settings, cache_duration=0)


def _set(backend, state, token=None):
    result = backend.set_state(state, token)
    assert result is not None
    return result


# ---- torch's rendezvous backend test mixin ----------------------------------------------------

def test_get_state_returns_what_was_set(impl):
    impl.backend.set_state(b"x")
    state, token = impl.backend.get_state()
    assert state == b"x" and token is not None


def test_get_state_of_an_empty_backend_is_none(impl):
    assert impl.backend.get_state() is None


def test_get_state_refuses_corrupt_state(impl):
    impl.corrupt()
    with pytest.raises(RendezvousStateError):
        impl.backend.get_state()


def test_set_state_creates_missing_state(impl):
    assert _set(impl.backend, b"x")[::2] == (b"x", True)
    assert _set(impl.backend, b"x")[1] is not None


def test_set_state_with_current_token_writes_and_moves_the_token(impl):
    _, token1, set1 = _set(impl.backend, b"x")
    state2, token2, set2 = _set(impl.backend, b"y", token1)
    assert (state2, set1, set2) == (b"y", True, True)
    assert token1 != token2


def test_set_state_with_stale_token_returns_current_state(impl):
    _, token1, _ = _set(impl.backend, b"x")
    state2, token2, _ = _set(impl.backend, b"y", token1)
    state3, token3, has_set = _set(impl.backend, b"z", token1)
    assert (state3, token3, has_set) == (state2, token2, False)


def test_set_state_without_token_on_existing_state_returns_it(impl):
    state1, token1, _ = _set(impl.backend, b"x")
    assert _set(impl.backend, b"y") == (state1, token1, False)


def test_set_state_with_invalid_token_returns_current_state(impl):
    state1, token1, _ = _set(impl.backend, b"x")
    assert _set(impl.backend, b"y", token="invalid") == (state1, token1, False)


# ---- what elastic-rt relies on beyond torch's cases ---------------------------------------------

def test_binary_state_round_trips(impl):
    blob = bytes(range(256)) * 4
    impl.backend.set_state(blob)
    assert impl.backend.get_state()[0] == blob


def test_torch_state_holder_syncs_through_the_backend(impl):
    """torch's own state holder pickles its state into the backend and reads it back."""
    holder = _holder(impl.backend)
    holder.state.participants[_NodeDesc("host", 1, 0)] = 0
    holder.mark_dirty()
    assert holder.sync() is True
    other = _holder(impl.backend)
    other.sync()
    assert list(other.state.participants) == [_NodeDesc("host", 1, 0)]


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


class _Maker:
    def __init__(self, host, port, run_id, secret):
        self.host, self.port, self.run_id, self.secret = host, port, run_id, secret

    def __call__(self):
        client = EtcdClient(EtcdConfig(endpoints=((self.host, self.port),)))
        return EtcdV3RendezvousBackend(client, self.run_id, secret=self.secret)


@pytest.mark.parametrize("secret", [None, SECRET], ids=["unsigned", "signed"])
def test_etcd_processes_racing_exactly_one_wins_per_round(etcd_server, run_id, secret):
    m = etcd_server.members[0]
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(4), ctx.Queue()
    procs = [ctx.Process(target=_race_worker, args=(_Maker(m.host, m.client_port, run_id, secret), i, barrier,
                                                     results)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    wins = dict(results.get(timeout=5) for _ in procs)
    assert sum(wins.values()) == 10  # ten rounds, one winner each


def test_etcd_backend_name_is_the_one_it_was_created_for(etcd_client, run_id):
    assert EtcdV3RendezvousBackend(etcd_client, run_id).name == "etcd-v3"
    assert EtcdV3RendezvousBackend(etcd_client, run_id, name="etcd-v3-torch").name == "etcd-v3-torch"


# ---- the envelope: state elastic-rt did not write is refused before torch unpickles it -------------

class _Trap:
    """Unpickling this touches a file: proof that a payload was (or was not) unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


def _refusal(exc_info, key: str) -> str:
    text = str(exc_info.value)
    assert "\n" not in text and key in text and f"etcdctl del {key}" in text and "--rdzv-id" in text, text
    return text


def _backend(etcd_client, run_id, secret=None):
    return EtcdV3RendezvousBackend(etcd_client, run_id, secret=secret)


def test_foreign_pickle_is_refused_and_never_unpickled(etcd_client, run_id, tmp_path):
    """What an older elastic-rt (no envelope) or anyone with write access to etcd would leave."""
    backend = _backend(etcd_client, run_id)
    trap = tmp_path / "unpickled"
    etcd_client.put(backend.key, pickle.dumps(_Trap(trap)))
    with pytest.raises(RendezvousStateError) as exc_info:
        _holder(backend).sync()
    assert "older" in _refusal(exc_info, backend.key)
    assert not trap.exists()


@pytest.mark.parametrize("writer,reader,words", [
    (None, SECRET, "is not signed"),
    (b"another-secret", SECRET, "signed with another secret"),
    (SECRET, None, "this node has no --rdzv-conf secret_file"),
], ids=["unsigned-read-by-signed", "wrong-secret", "signed-read-by-unsigned"])
def test_signature_mismatch_is_refused_before_unpickling(etcd_client, run_id, tmp_path, writer, reader, words):
    trap = tmp_path / "unpickled"
    _backend(etcd_client, run_id, writer).set_state(pickle.dumps(_Trap(trap)))
    backend = _backend(etcd_client, run_id, reader)
    with pytest.raises(RendezvousStateError) as exc_info:
        backend.get_state()
    text = _refusal(exc_info, backend.key)
    assert words in text and "same --rdzv-conf secret_file" in text
    with pytest.raises(RendezvousStateError):  # a losing write returns the current state: checked too
        backend.set_state(b"mine")
    assert not trap.exists()


def test_altered_payload_fails_the_checksum(etcd_client, run_id):
    backend = _backend(etcd_client, run_id)
    backend.set_state(b"state")
    kv, _ = etcd_client.get(backend.key)
    etcd_client.put(backend.key, kv.value[:-1] + b"X")
    with pytest.raises(RendezvousStateError, match="checksum mismatch") as exc_info:
        backend.get_state()
    _refusal(exc_info, backend.key)


def test_state_copied_from_another_run_is_refused(etcd_client, run_id):
    """The digest covers the key: a signed state of run A is no state of run B, same secret or not."""
    a = _backend(etcd_client, run_id + "-a", SECRET)
    b = _backend(etcd_client, run_id + "-b", SECRET)
    a.set_state(b"state of a")
    kv, _ = etcd_client.get(a.key)
    etcd_client.put(b.key, kv.value)
    with pytest.raises(RendezvousStateError, match="another secret"):
        b.get_state()


def test_unknown_envelope_version_is_refused(etcd_client, run_id):
    backend = _backend(etcd_client, run_id)
    sealed = StateEnvelope(backend.key).seal(b"state")
    etcd_client.put(backend.key, MAGIC + bytes((2,)) + sealed[len(MAGIC) + 1:])
    with pytest.raises(RendezvousStateError, match="envelope version 2"):
        backend.get_state()


def test_nodes_with_the_same_secret_share_state(etcd_client, etcd_server, run_id):
    m = etcd_server.members[0]
    other_client = EtcdClient(EtcdConfig(endpoints=((m.host, m.client_port),)))
    try:
        mine, theirs = _backend(etcd_client, run_id, SECRET), _backend(other_client, run_id, SECRET)
        _, token, _ = mine.set_state(b"one")
        assert theirs.get_state() == (b"one", token)
        assert theirs.set_state(b"two", token)[2]
        assert mine.get_state()[0] == b"two"
    finally:
        other_client.close()


def test_stored_state_is_sealed_not_raw(etcd_client, run_id):
    backend = _backend(etcd_client, run_id, SECRET)
    backend.set_state(b"payload")
    kv, _ = etcd_client.get(backend.key)
    assert kv.value.startswith(MAGIC) and kv.value.endswith(b"payload") and kv.value != b"payload"
