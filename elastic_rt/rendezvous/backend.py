"""torch's RendezvousBackend on etcd v3: the rendezvous state blob, compare-and-set on mod_revision."""

from __future__ import annotations

from torch.distributed.elastic.rendezvous import RendezvousConnectionError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient
from elastic_rt.rendezvous.keys import RunKeys


class EtcdV3RendezvousBackend(RendezvousBackend):
    """State under `/elastic-rt/<run_id>/state`; the fencing token is the key's mod_revision.

    set_state with token None creates the key only if it does not exist; with a
    token, it writes only if nobody wrote since that revision. A failed write
    returns the current state and token, as torch's contract asks.
    """

    def __init__(self, client: EtcdClient, run_id: str, *, name: str = "etcd-v3") -> None:
        self._client = client
        self._key = RunKeys(run_id).state
        self._name = name  # torch requires it to equal the --rdzv-backend it was created for

    @property
    def name(self) -> str:
        return self._name

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv, _ = self._client.get(self._key)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        return None if kv is None else (kv.value, kv.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, int):
            try:
                token = int(token)
            except (TypeError, ValueError):
                current = self.get_state()
                return None if current is None else (*current, False)
        try:
            ok, kv = self._client.compare_and_put(self._key, state, expected_mod_revision=token)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if kv is None:
            # Written by us and deleted at once by somebody else: report the absence.
            return None
        return kv.value, kv.mod_revision, ok

