"""What the job secret signs among etcd-v3's keys (each round's final, `closed`, rank 0's store address) and the
check that a round's master is the address its rank 0 registered."""

from __future__ import annotations

import hashlib
import hmac
import json
from typing import Mapping

from elastic_rt.rendezvous.etcd_client import KeyValue

_DOMAIN = b"elastic-rt etcd-v3 key v1\0"
SIG = "sig"


class KeySigner:
    """Seals JSON values for one job: with a secret, an HMAC-SHA256 over the etcd key and the value's canonical
    JSON rides in the value as "sig"; without one, values are plain JSON and every check passes (nothing to
    check with). The signature covers the key, so a value copied to another key (another round, another run)
    is refused."""

    def __init__(self, secret: bytes | None = None) -> None:
        if secret is not None and not secret:
            raise ValueError("an empty secret signs nothing; pass None for no signature")
        self._secret = secret

    @property
    def signs(self) -> bool:
        return self._secret is not None

    def _mac(self, key: str, data: Mapping[str, object]) -> str:
        body = json.dumps({k: v for k, v in data.items() if k != SIG}, sort_keys=True, separators=(",", ":"))
        return hmac.new(self._secret or b"", _DOMAIN + key.encode() + b"\0" + body.encode(), hashlib.sha256).hexdigest()

    def seal(self, key: str, data: Mapping[str, object]) -> bytes:
        """The value to write at `key`: `data` as JSON, signed when the job has a secret."""
        out = dict(data)
        if self._secret is not None:
            out[SIG] = self._mac(key, data)
        return json.dumps(out).encode()

    def refusal(self, key: str, value: bytes) -> str | None:
        """Why the value at `key` is not the job's own (one phrase), or None when it is (or nothing can tell)."""
        if self._secret is None:
            return None
        try:
            data = json.loads(value.decode())
        except (UnicodeDecodeError, ValueError):
            return "is not JSON"
        if not isinstance(data, dict) or not isinstance(data.get(SIG), str):
            return "is not signed, but this node has --rdzv-conf secret_file"
        if not hmac.compare_digest(data[SIG], self._mac(key, data)):
            return "is signed with another secret (or was altered)"
        return None

    def refuses(self, kv: KeyValue) -> str | None:
        return self.refusal(kv.key, kv.value)


def registered_addr(kv: KeyValue | None) -> str | None:
    """The address a node registered in its alive/ key (None: no key, or no address in it)."""
    if kv is None:
        return None
    try:
        addr = json.loads(kv.value.decode()).get("addr")
    except (UnicodeDecodeError, ValueError, AttributeError):
        return None
    return addr if isinstance(addr, str) else None


def master_refusal(master: tuple[str, int], rank0: str, registered: str | None) -> str | None:
    """Why a round's master address is not accepted (None: it is): it must be the address that the member
    ranked 0 registered (its alive/ key: `registered`, None when that key is gone)."""
    if registered is None:
        return f"rank 0 ({rank0}) has no registration to check it against"
    if master[0] != registered:
        return f"it is not the address rank 0 ({rank0}) registered ({registered})"
    return None
