"""torch's RendezvousBackend on etcd v3: one state blob in a checked (optionally signed) envelope, CAS."""

from __future__ import annotations

import hashlib
import hmac
from typing import NoReturn

from torch.distributed.elastic.rendezvous import RendezvousConnectionError, RendezvousStateError
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import RendezvousBackend, Token

from elastic_rt.errors import EtcdUnavailableError
from elastic_rt.rendezvous.etcd_client import EtcdClient
from elastic_rt.rendezvous.keys import RunKeys

# Envelope, version 1: MAGIC, VERSION, KIND, 32-byte digest, then torch's bytes (a pickle).
# The digest covers the key as well, so state copied from another key (another run) is refused.
MAGIC = b"ERTS"
VERSION = 1
CHECKSUM, SIGNED = 0, 1  # KIND: sha256 (detects foreign or damaged state), or HMAC-SHA256 with the job secret
_HEADER = len(MAGIC) + 2
_DIGEST = 32
_DOMAIN = b"elastic-rt torch rendezvous state v1\0"


class StateEnvelope:
    """Wraps torch's state bytes for one etcd key; refuses, before anyone unpickles, what it did not write."""

    def __init__(self, key: str, secret: bytes | None = None) -> None:
        if secret is not None and not secret:
            raise ValueError("an empty secret signs nothing; pass None for no signature")
        self.key = key
        self._secret = secret

    def _digest(self, kind: int, payload: bytes) -> bytes:
        material = _DOMAIN + self.key.encode() + b"\0" + payload
        if kind == SIGNED:
            return hmac.new(self._secret or b"", material, hashlib.sha256).digest()
        return hashlib.sha256(material).digest()

    def seal(self, payload: bytes) -> bytes:
        kind = CHECKSUM if self._secret is None else SIGNED
        return MAGIC + bytes((VERSION, kind)) + self._digest(kind, payload) + payload

    def open(self, blob: bytes) -> bytes:
        """torch's bytes from `blob`, or RendezvousStateError (one line: the key, what is wrong, the fix)."""
        if not blob.startswith(MAGIC) or len(blob) < _HEADER + _DIGEST:
            hint = " (an elastic-rt older than this one, without an envelope?)" if blob[:1] == b"\x80" else ""
            self._refuse(f"was not written by elastic-rt's etcd-v3-torch backend{hint}")
        version, kind = blob[len(MAGIC)], blob[len(MAGIC) + 1]
        if version != VERSION:
            self._refuse(f"has envelope version {version}; this elastic-rt reads version {VERSION}")
        digest, payload = blob[_HEADER:_HEADER + _DIGEST], blob[_HEADER + _DIGEST:]
        if kind == CHECKSUM:
            if self._secret is not None:
                self._refuse("is not signed, but this node has --rdzv-conf secret_file",
                             same_secret=True)
            if not hmac.compare_digest(digest, self._digest(CHECKSUM, payload)):
                self._refuse("is corrupt (checksum mismatch)")
        elif kind == SIGNED:
            if self._secret is None:
                self._refuse("is signed, but this node has no --rdzv-conf secret_file", same_secret=True)
            if not hmac.compare_digest(digest, self._digest(SIGNED, payload)):
                self._refuse("is signed with another secret (or was altered)", same_secret=True)
        else:
            self._refuse(f"has an unknown envelope kind {kind}")
        return payload

    def _refuse(self, why: str, *, same_secret: bool = False) -> NoReturn:
        first = "give every node of the job the same --rdzv-conf secret_file, or " if same_secret else ""
        raise RendezvousStateError(
            f"rendezvous state at etcd key {self.key} {why}; refusing to unpickle it: "
            f"{first}remove it (etcdctl del {self.key}) or start the job with a new --rdzv-id"
        )


class EtcdV3RendezvousBackend(RendezvousBackend):
    """State under `/elastic-rt/<run_id>/state`; the fencing token is the key's mod_revision.

    set_state with token None creates the key only if it does not exist; with a
    token, it writes only if nobody wrote since that revision. A failed write
    returns the current state and token, as torch's contract asks. Every state
    handed to torch (read, or returned by a failed write) has been checked by the
    envelope first: torch unpickles it.
    """

    def __init__(self, client: EtcdClient, run_id: str, *, name: str = "etcd-v3",
                 secret: bytes | None = None) -> None:
        self._client = client
        self._key = RunKeys(run_id).state
        self._envelope = StateEnvelope(self._key, secret)
        self._name = name  # torch requires it to equal the --rdzv-backend it was created for

    @property
    def name(self) -> str:
        return self._name

    @property
    def key(self) -> str:
        return self._key

    def get_state(self) -> tuple[bytes, Token] | None:
        try:
            kv, _ = self._client.get(self._key)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        return None if kv is None else (self._envelope.open(kv.value), kv.mod_revision)

    def set_state(self, state: bytes, token: Token | None = None) -> tuple[bytes, Token, bool] | None:
        if token is not None and not isinstance(token, int):
            try:
                token = int(token)
            except (TypeError, ValueError):
                current = self.get_state()
                return None if current is None else (*current, False)
        try:
            ok, kv = self._client.compare_and_put(self._key, self._envelope.seal(state), expected_mod_revision=token)
        except EtcdUnavailableError as exc:
            raise RendezvousConnectionError(str(exc)) from exc
        if kv is None:
            # A token for a key that no longer exists: report the absence.
            return None
        if ok:
            return state, kv.mod_revision, True
        return self._envelope.open(kv.value), kv.mod_revision, False
