"""gRPC over HTTP/2 as bytes: frames, request header blocks, response header decoding, messages, statuses.

What connection.py needs to speak to etcd's gRPC server and nothing more (RFC 9113, RFC 7541, the
gRPC HTTP/2 protocol). Requests are encoded without HPACK's dynamic table (literal fields; the
per-method part of each block is built once). The client announces a header table size of 0, so
the server's blocks decode without state, and a block seen before is decoded from a cache.
"""

from __future__ import annotations

import struct
import urllib.parse

import grpc  # StatusCode only: the client reports failures as gRPC statuses
import hpack

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM = ACK = 0x1
END_HEADERS = 0x4
PADDED = 0x8
PRIORITY_FLAG = 0x20
SETTINGS_HEADER_TABLE_SIZE, SETTINGS_ENABLE_PUSH = 0x1, 0x2
SETTINGS_INITIAL_WINDOW_SIZE, SETTINGS_MAX_FRAME_SIZE = 0x4, 0x5
MAX_WINDOW = 2**31 - 1
DEFAULT_WINDOW = 65535
DEFAULT_MAX_FRAME = 16384
CANCEL = 0x8  # RST_STREAM error code

_HEAD = struct.Struct(">IBI")  # (length << 8 | type), flags, stream id
_SETTING = struct.Struct(">HI")
_U32 = struct.Struct(">I")
_MESSAGE = struct.Struct(">BI")  # compressed flag, length
HEAD_SIZE = _HEAD.size


def frame(ftype: int, flags: int, stream_id: int, payload: bytes = b"") -> bytes:
    return _HEAD.pack((len(payload) << 8) | ftype, flags, stream_id) + payload


unpack_head = _HEAD.unpack_from  # (length << 8 | type, flags, stream id with its reserved bit) at (buf, offset)


def frame_head(buf, offset: int) -> tuple[int, int, int, int]:
    """(length, type, flags, stream id) of the frame header at buf[offset:offset + 9]."""
    lt, flags, sid = _HEAD.unpack_from(buf, offset)
    return lt >> 8, lt & 0xFF, flags, sid & MAX_WINDOW


def client_settings() -> bytes:
    """This client's SETTINGS: no dynamic header table, no push, the largest stream windows (the
    connection's is opened just as wide by the WINDOW_UPDATE that follows)."""
    body = b"".join(_SETTING.pack(k, v) for k, v in ((SETTINGS_HEADER_TABLE_SIZE, 0), (SETTINGS_ENABLE_PUSH, 0),
                                                     (SETTINGS_INITIAL_WINDOW_SIZE, MAX_WINDOW)))
    return frame(SETTINGS, 0, 0, body) + window_update(0, MAX_WINDOW - DEFAULT_WINDOW)


def parse_settings(payload: bytes) -> dict[int, int]:
    return dict(_SETTING.unpack_from(payload, i) for i in range(0, len(payload) - len(payload) % 6, 6))


def window_update(stream_id: int, increment: int) -> bytes:
    return frame(WINDOW_UPDATE, 0, stream_id, _U32.pack(increment))


def rst_stream(stream_id: int, code: int = CANCEL) -> bytes:
    return frame(RST_STREAM, 0, stream_id, _U32.pack(code))


def u32(payload: bytes, offset: int = 0) -> int:
    return _U32.unpack_from(payload, offset)[0] & MAX_WINDOW


def unpad(flags: int, payload: bytes) -> bytes:
    if flags & PADDED:
        return payload[1:len(payload) - payload[0]]
    return payload


# ---- HPACK, the request side: literal fields, never indexed ---------------------------------------
def _int(value: int, prefix_bits: int, first: int = 0) -> bytes:
    limit = (1 << prefix_bits) - 1
    if value < limit:
        return bytes([first | value])
    out = bytearray([first | limit])
    value -= limit
    while value >= 128:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _string(data: bytes) -> bytes:
    return _int(len(data), 7) + data


def literal(name: bytes, value: bytes) -> bytes:
    """A header field without indexing, its name a literal too."""
    return b"\x00" + _string(name) + _string(value)


def _indexed_name(index: int, value: bytes) -> bytes:
    return _int(index, 4) + _string(value)


_REQUEST_TAIL = _indexed_name(31, b"application/grpc") + literal(b"te", b"trailers")  # content-type, te


def request_prefix(path: str, authority: str, *, tls: bool) -> bytes:
    """The constant part of a request's header block: :method POST (static 3), :scheme (6 or 7), :path (4),
    :authority (1), content-type (31), te: trailers."""
    return (b"\x83" + (b"\x87" if tls else b"\x86") + _indexed_name(4, path.encode())
            + _indexed_name(1, authority.encode()) + _REQUEST_TAIL)


def timeout_field(timeout_s: float) -> bytes:
    """grpc-timeout, in whole milliseconds (at most 8 digits, as the protocol allows)."""
    return literal(b"grpc-timeout", b"%dm" % min(99_999_999, max(1, int(timeout_s * 1000 + 0.999))))


_DECODED: dict[bytes, dict[bytes, bytes]] = {}  # header block -> its fields, decoded with an empty table of size 0


class HeaderDecoder:
    """Response header blocks -> {name: value}. The table size is 0 (client_settings()): once the member's
    encoder applied it, a block decodes the same on every connection, and blocks seen before (every OK
    response's) come from one cache shared by the process's connections."""

    def __init__(self) -> None:
        self._decoder = hpack.Decoder()
        self._decoder.max_allowed_table_size = 0
        self._stateless = False  # the table's size is 0, as it stays: the member may not raise it above our setting

    def decode(self, block: bytes) -> dict[bytes, bytes]:
        if not self._stateless and block[:1] == b"\x20":  # the member's size update to 0 opens its first block
            block = block.lstrip(b"\x20")  # (001 and a 5-bit size of 0: never a field's first byte): applied here,
            self._decoder.header_table_size = 0  # so that the rest of the block is looked up too (hpack's first
            self._stateless = True  # decode of a block costs about 0.1 ms of a first round, cold)
        stateless = self._stateless = self._stateless or self._decoder.header_table_size == 0
        if stateless:
            cached = _DECODED.get(block)
            if cached is not None:
                return cached
        headers = dict(self._decoder.decode(block, raw=True))
        if stateless and len(_DECODED) < 256:
            _DECODED[block] = headers
        return headers


# ---- gRPC -----------------------------------------------------------------------------------------
def message(body: bytes) -> bytes:
    return _MESSAGE.pack(0, len(body)) + body


def split_messages(buf: bytearray) -> list[bytes]:
    """The complete length-prefixed messages at the front of buf (removed from it)."""
    out, off, n = [], 0, len(buf)
    while n - off >= 5:
        flag, length = _MESSAGE.unpack_from(buf, off)
        if n - off - 5 < length:
            break
        out.append(bytes(buf[off + 5:off + 5 + length]))
        off += 5 + length
    if off:
        del buf[:off]
    return out


class CallError(grpc.RpcError):
    """A call or stream that failed, as a gRPC status (EtcdClient translates it at its boundary)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def __repr__(self) -> str:
        return f"CallError({self._code.name}, {self._details!r})"


_CODES = {c.value[0]: c for c in grpc.StatusCode}
_HTTP = {400: grpc.StatusCode.INTERNAL, 401: grpc.StatusCode.UNAUTHENTICATED, 403: grpc.StatusCode.PERMISSION_DENIED,
         404: grpc.StatusCode.UNIMPLEMENTED, 429: grpc.StatusCode.UNAVAILABLE, 502: grpc.StatusCode.UNAVAILABLE,
         503: grpc.StatusCode.UNAVAILABLE, 504: grpc.StatusCode.UNAVAILABLE}
_RESET = {7: grpc.StatusCode.UNAVAILABLE, 8: grpc.StatusCode.CANCELLED, 11: grpc.StatusCode.RESOURCE_EXHAUSTED,
          12: grpc.StatusCode.PERMISSION_DENIED}


def http_status_error(headers: dict[bytes, bytes]) -> CallError | None:
    """The error a response's HTTP status means (gRPC answers 200), or None."""
    status = headers.get(b":status", b"200")
    if status == b"200":
        return None
    code = _HTTP.get(int(status) if status.isdigit() else 0, grpc.StatusCode.UNKNOWN)
    return CallError(code, f"HTTP status {status.decode(errors='replace')} from etcd")


def trailer_status(headers: dict[bytes, bytes]) -> CallError | None:
    """None for grpc-status 0, else the CallError the trailers say (no grpc-status: UNKNOWN)."""
    raw = headers.get(b"grpc-status")
    if raw == b"0":
        return None
    code = _CODES.get(int(raw), grpc.StatusCode.UNKNOWN) if raw is not None and raw.isdigit() else \
        grpc.StatusCode.UNKNOWN
    details = urllib.parse.unquote(headers.get(b"grpc-message", b"").decode("utf-8", errors="replace"))
    return CallError(code, details or f"grpc-status {raw!r}")


def reset_error(payload: bytes) -> CallError:
    code = u32(payload) if len(payload) >= 4 else 0
    return CallError(_RESET.get(code, grpc.StatusCode.INTERNAL), f"etcd reset the stream (HTTP/2 error {code})")
