"""The etcd requests a round sends, encoded as protobuf bytes by hand.

Byte for byte what the protobuf runtime's SerializeToString() gives for the same message (fields in number order,
proto3 defaults left out, a oneof member written even when it holds its default); tests/unit/test_pb.py checks
that against the runtime for generated inputs. Why: built as message objects and serialized, the two requests of a
restart cost about 0.2 ms of CPU after a pause (the runtime's code and tables are cold by then), these bytes about
0.13 (benchmarks/agent_round_cpu.py measures the rounds). Replies are still parsed by the runtime: a final of a
thousand members is tens of KiB, which Python would parse far slower.

Every function takes keys and values as bytes and returns the encoded message (or RequestOp) as bytes.
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def varint(n: int) -> bytes:
    """An unsigned varint; a negative int64 as protobuf writes it (ten bytes, two's complement)."""
    if 0 <= n < 0x80:
        return bytes((n,))
    n &= _MASK64
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


_LENGTH = [bytes((n,)) for n in range(0x80)]  # the one-byte lengths


def _ld(tag: bytes, data: bytes) -> bytes:
    """A length-delimited field (bytes, or a message), written whatever its length."""
    n = len(data)
    return tag + (_LENGTH[n] if n < 0x80 else varint(n)) + data


def _bytes(tag: bytes, data: bytes) -> bytes:
    """A bytes field outside a oneof: absent when empty."""
    return _ld(tag, data) if data else b""


def _int(tag: bytes, n: int) -> bytes:
    """An integer (or enum, or bool) field outside a oneof: absent when 0."""
    return tag + varint(n) if n else b""


# ---- Compare (result EQUAL is 0 and never written; its target's value is a oneof member: always written) ----------
def compare_created(key: bytes, create_revision: int = 0) -> bytes:
    """key's create_revision == create_revision (0: the key is absent)."""
    return b"\x10\x01" + _bytes(b"\x1a", key) + b"\x28" + varint(create_revision)


def compare_mod(key: bytes, mod_revision: int) -> bytes:
    """key's mod_revision == mod_revision."""
    return b"\x10\x02" + _bytes(b"\x1a", key) + b"\x30" + varint(mod_revision)


def compare_value(key: bytes, value: bytes) -> bytes:
    """key's value == value."""
    return b"\x10\x03" + _bytes(b"\x1a", key) + _ld(b"\x3a", value)


def compare_version(key: bytes, version: int, range_end: bytes = b"") -> bytes:
    """The version of key (or of every key in [key, range_end)) == version (target VERSION is 0: not written)."""
    return _bytes(b"\x1a", key) + b"\x20" + varint(version) + _bytes(b"\x82\x04", range_end)


# ---- RequestOp ---------------------------------------------------------------------------------------------
def range_op(key: bytes, range_end: bytes = b"", *, limit: int = 0, keys_only: bool = False) -> bytes:
    body = _bytes(b"\x0a", key)
    if range_end:
        body += _ld(b"\x12", range_end)
    if limit:
        body += b"\x18" + varint(limit)
    if keys_only:
        body += b"\x40\x01"
    return _ld(b"\x0a", body)


def put_op(key: bytes, value: bytes, lease: int = 0) -> bytes:
    body = _bytes(b"\x0a", key)
    if value:
        body += _ld(b"\x12", value)
    if lease:
        body += b"\x18" + varint(lease)
    return _ld(b"\x12", body)


def delete_op(key: bytes, range_end: bytes = b"") -> bytes:
    return _ld(b"\x1a", _bytes(b"\x0a", key) + _bytes(b"\x12", range_end))


def txn_op(txn_request: bytes) -> bytes:
    """A transaction nested in another (a TxnRequest's bytes: txn())."""
    return _ld(b"\x22", txn_request)


# ---- requests ------------------------------------------------------------------------------------------------
def txn(compare: list[bytes], success: list[bytes], failure: list[bytes]) -> bytes:
    """A TxnRequest of encoded Compares and RequestOps."""
    out = []
    for tag, items in ((b"\x0a", compare), (b"\x12", success), (b"\x1a", failure)):
        for item in items:  # _ld(), inline: a round's transaction has a dozen of them
            n = len(item)
            out += (tag + (_LENGTH[n] if n < 0x80 else varint(n)), item)
    return b"".join(out)


def lease_grant(ttl: int, lease_id: int = 0) -> bytes:
    return _int(b"\x08", ttl) + _int(b"\x10", lease_id)


def lease_keep_alive(lease_id: int) -> bytes:
    return _int(b"\x08", lease_id)


def watch_create(key: bytes, range_end: bytes = b"", start_revision: int = 0, *, no_put: bool = False) -> bytes:
    """A WatchRequest that creates a watcher (its create_request, a oneof member); `no_put`: the NOPUT filter (0,
    packed: a repeated enum)."""
    body = _bytes(b"\x0a", key) + _bytes(b"\x12", range_end) + _int(b"\x18", start_revision)
    if no_put:
        body += b"\x2a\x01\x00"
    return _ld(b"\x0a", body)
